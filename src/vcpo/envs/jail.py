"""Child side of the sandbox: namespaces, a read-only filesystem view, the privilege drop, limits and the supervisor.

:mod:`vcpo.envs.isolation` runs this file as ``python -I -S jail.py SPEC`` (a marshalled dict, hex-encoded) with
an empty environment, so it uses the standard library only, and few modules of it: their import time is part of
every run's start-up. The process tree: this *supervisor* (in the caller's PID namespace, killable by
the caller, and the one that cleans up) -> with namespaces, an *init* (PID 1 of a new PID namespace, in a mount
namespace of its own; when it dies the kernel kills every process inside) -> the *payload* process (unprivileged,
limited) that runs the untrusted work.
"""

from __future__ import annotations

import ctypes
import importlib
import marshal
import os
import resource
import select
import signal
import stat
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
_MOUNT_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024,
                       "nodiratime": 2048, "relatime": 1 << 21}
UID_BASE = 1_500_000_000  # the payload runs as UID_BASE + the supervisor's PID: one uid per live sandbox
EXIT_SETUP = 125  # the sandbox could not be set up (the message is in the report)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
           f"prctl({option})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _load_landlock():
    """``landlock.py`` beside this file, loaded without putting this directory on ``sys.path``."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "landlock.py")
    namespace = {"__name__": "_vcpo_landlock"}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return namespace["restrict"]


def main() -> None:
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the caller dies -> we kill the tree, clean up and exit
    if os.getppid() != spec["parent_pid"]:  # it died before the line above
        os._exit(EXIT_SETUP)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    report = {"isolation": [], "uid": os.getuid()}
    if spec["namespaces"]:
        try:
            # the mount namespace is init's alone: here, the working directory can be removed afterwards
            _check(_libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
            report["isolation"] += ["pid-namespace", "net-namespace", "ipc-namespace"]
        except (OSError, AttributeError) as exc:
            report["namespace_error"] = str(exc)
    pidns = "pid-namespace" in report["isolation"]
    uid = UID_BASE + os.getpid() if os.getuid() == 0 and (pidns or _readable_by_others(spec)) else None
    if not pidns:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphaned descendants come to us, so the sweep can find them
    lifeline_r, lifeline_w = os.pipe()  # EOF on the read end: the supervisor is gone
    status_r, status_w = os.pipe()  # init -> supervisor: the payload's wait status
    child = os.fork()
    if child == 0:
        os.close(lifeline_w)
        os.close(status_r)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([lifeline_r], [], [], 0)[0]:
            os._exit(EXIT_SETUP)
        _child(spec, report, uid, status_w if pidns else None)
    os.close(status_w)
    _supervise(spec, child, uid, pidns, status_r)


def _supervise(spec: dict, child: int, uid: int | None, pidns: bool, status_r: int) -> None:
    """Wait for the payload (or init), then kill what it left and remove the working directory; on SIGTERM (the
    caller's deadline, or the caller's death) do that at once. Exit as the payload did."""

    def stop(*_):
        kill_quietly(child)
        try:
            os.waitpid(child, 0)
        except ChildProcessError:
            pass
        _sweep(uid, pidns)
        _remove_tree(spec["workdir"])
        os._exit(128 + signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the caller sees EOF once the sandboxed processes are gone, not when we are
        os.dup2(devnull, fd)
    os.close(spec["report_fd"])
    _, status = os.waitpid(child, 0)
    relayed = os.read(status_r, 64)
    if relayed:
        status = int(relayed)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _sweep(uid, pidns)
    _remove_tree(spec["workdir"])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _sweep(uid: int | None, pidns: bool) -> None:
    """Kill whatever the payload left behind. With a PID namespace the kernel already did (init died)."""
    if pidns:
        return
    if uid is not None:  # kill(-1) by the sandbox uid reaches every process of that uid, escaped or not
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
                os._exit(0)
            os.waitpid(pid, 0)
    for _ in range(100):  # same uid as the caller: walk our descendants (orphans are reparented to us)
        mine = _descendants(os.getpid())
        if not mine:
            break
        for pid in mine:
            kill_quietly(pid)
        reap_exited()
        time.sleep(0.005)


def _remove_tree(path: str) -> None:
    """``rm -rf path``, best effort (the caller tries again), without shutil: its import would slow every start.
    Links are removed, never followed; nothing runs in the sandbox any more when this runs."""
    try:
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                os.unlink(os.path.join(root, name))
            for name in dirs:
                if not os.path.islink(os.path.join(root, name)):
                    os.rmdir(os.path.join(root, name))
        os.rmdir(path)
    except OSError:
        pass


def kill_quietly(pid: int) -> None:
    """SIGKILL ``pid`` (-1: every process this uid may signal but the caller); gone already is fine."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap_exited() -> None:
    """Collect every child that has exited, without waiting for the others (no zombies left)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def _child(spec: dict, report: dict, uid: int | None, status_w: int | None) -> None:
    """In the new namespaces: set up the filesystem, then (as init) fork the payload, or be the payload."""
    try:
        if status_w is not None:  # PID 1 of the new namespace: give it a mount namespace of its own too
            _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            report["isolation"].append("mount-namespace")
            _setup_mounts(spec, uid)
            report["isolation"].append("read-only-filesystem")
        payload = os.fork() if status_w is not None else 0
    except Exception as exc:  # a step that the environment allowed failed: run nothing
        _fail(spec, report, exc)
    if payload == 0:
        if status_w is not None:
            os.close(status_w)
        _payload(spec, report, uid)
    os.close(spec["report_fd"])
    while True:  # PID 1: reap every orphan until the payload itself exits
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(EXIT_SETUP)
        if pid == payload:
            os.write(status_w, str(status).encode())
            os._exit(0)


def _fail(spec: dict, report: dict, exc: BaseException) -> None:
    _send_report(spec, {**report, "error": f"sandbox setup failed: {exc.__class__.__name__}: {exc}"})
    os._exit(EXIT_SETUP)


def _setup_mounts(spec: dict, uid: int | None) -> None:
    """Private mounts: a fresh /proc, the interpreter's files visible to the sandbox uid, a tmpfs working
    directory, and everything else read-only."""
    workdir = spec["workdir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _expose(spec["read_paths"] + list(sys.path))
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['limits']['workdir_mb']}m,mode=0700{owner}")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = _unescape(fields[4])
        if target == workdir:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for option in fields[5].split(","):
            flags |= _MOUNT_OPTION_FLAGS.get(option, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            if os.path.exists(target):  # a mount hidden under a later one cannot be reached, which is fine
                raise


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (``\\040``)."""
    parts = field.split("\\")
    return parts[0] + "".join(chr(int(p[:3], 8)) + p[3:] for p in parts[1:])


def _expose(paths: list[str]) -> None:
    """Make ``paths`` reachable by an unprivileged uid: a directory it cannot traverse (e.g. /root, mode 700)
    is covered by an empty tmpfs into which only the needed paths are bind-mounted."""
    wanted = sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})
    covers: dict[str, list[str]] = {}
    for path in wanted:
        parts = path.split("/")
        for i in range(2, len(parts)):
            ancestor = "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                covers.setdefault(ancestor, []).append(path)
                break
    for ancestor, inside in covers.items():
        fds = {p: os.open(p, os.O_PATH) for p in inside}
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for path in inside:
            if any(path.startswith(other + "/") for other in inside):
                continue  # already visible through a bind of its ancestor
            if os.path.isdir(f"/proc/self/fd/{fds[path]}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "w").close()
            _mount(f"/proc/self/fd/{fds[path]}", path, None, MS_BIND | MS_REC)
        for fd in fds.values():
            os.close(fd)


def _readable_by_others(spec: dict) -> bool:
    """Without a mount namespace the uid can only be dropped if the interpreter's files are world-readable."""
    for path in spec["read_paths"] + list(sys.path):
        parts = os.path.realpath(path).split("/") if path and os.path.exists(path) else []
        for i in range(2, len(parts) + 1):
            if not os.stat("/".join(parts[:i])).st_mode & stat.S_IXOTH:
                return False
    return True


def _payload(spec: dict, report: dict, uid: int | None) -> None:
    """Drop to the sandbox uid, apply Landlock and the limits, report what is in force, run the work."""
    try:
        os.chdir(spec["workdir"])
        landlock_restrict = _load_landlock()
        entry = code = None
        if spec["payload"]["kind"] == "call":  # import the (trusted) module while every file is readable
            sys.path[:0] = spec["read_paths"]
            module_name, _, func = spec["payload"]["target"].partition(":")
            entry = getattr(importlib.import_module(module_name), func)
        else:
            code = sys.stdin.buffer.read()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)  # reading stdin gets EOF
            os.close(devnull)
        if uid is not None:
            if "mount-namespace" not in report["isolation"]:  # the caller's temporary directory, not a tmpfs
                os.chown(spec["workdir"], uid, uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            report["isolation"].append("unprivileged-uid")
        report["uid"] = os.getuid()
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        report["isolation"] += landlock_restrict(spec["workdir"])
        _set_limits(spec["limits"], uid is None)
        report["isolation"].append("rlimits")
    except Exception as exc:
        _fail(spec, report, exc)
    _send_report(spec, report)
    os.environ.clear()  # the interpreter's own locale coercion (LC_CTYPE) included: nothing from outside
    if entry is not None:
        entry(spec["payload"].get("args", {}))
        os._exit(0)
    _run_code(code)


def _set_limits(limits: dict, shared_uid: bool) -> None:
    """Address space (beyond what is mapped now), CPU seconds, processes, file size, open files, no core."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    nproc = limits["max_processes"]
    if shared_uid:  # RLIMIT_NPROC counts every process of the uid, the caller's included
        nproc += sum(1 for d in os.listdir("/proc") if d.isdigit() and _owned(d))
    pairs = {
        resource.RLIMIT_AS: mapped + limits["memory_mb"] * 2**20,
        resource.RLIMIT_NPROC: nproc,
        resource.RLIMIT_FSIZE: limits["max_file_mb"] * 2**20,
        resource.RLIMIT_NOFILE: limits["max_open_files"],
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_MEMLOCK: 0,
        resource.RLIMIT_MSGQUEUE: 0,
    }
    for which, value in pairs.items():
        resource.setrlimit(which, (value, value))
    if limits["cpu_s"] is not None:  # SIGXCPU at the soft limit, SIGKILL one second later
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))


def _owned(pid: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _send_report(spec: dict, report: dict) -> None:
    os.write(spec["report_fd"], repr(report).encode() + b"\n")
    os.close(spec["report_fd"])


def _run_code(code: bytes) -> None:
    """Run ``code`` as ``__main__`` the way ``python -c`` would: a traceback and exit 1 on an exception."""
    import types

    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    sys.argv = ["-c"]
    status = 0
    try:
        exec(compile(code, "<sandbox>", "exec"), main_module.__dict__)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = status or 1
    os._exit(status & 0xFF)


if __name__ == "__main__":
    main()
