"""Hostile programs against run_python: each test asserts containment (what did not happen outside), not just
that nothing crashed. Runs as whoever runs the suite; on these machines and in CI that is root, the hard case."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import uuid

import pytest

from vcpo.envs.sandbox import run_python

from conftest import processes_with, sleeper_code


def test_infinite_loop_is_killed_at_the_deadline():
    r = run_python("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and r.exit_code is None
    assert r.duration_s < 3.0  # 1 s deadline + the supervisor's sweep, never the loop's own pace


def test_cpu_limit_kills_a_busy_loop_before_the_wall_deadline():
    r = run_python("while True:\n    pass", timeout_s=30.0, cpu_s=1)
    assert not r.timed_out and r.exit_code in (-24, -9)  # SIGXCPU at 1 s of CPU, SIGKILL at 2 s


def test_memory_bomb_fails_inside():
    r = run_python("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_growing_memory_bomb_fails_inside():
    r = run_python("a = []\nwhile True:\n    a.append(bytearray(10**7))", memory_mb=256, timeout_s=10)
    assert r.exit_code == 1 and "MemoryError" in r.stderr


def test_fork_bomb_is_capped_and_leaves_nothing():
    marker = f"forkbomb-{uuid.uuid4().hex}"
    code = (f"import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            f"            os.execv('/bin/sleep', ['/bin/sleep', '60', '{marker}'])\n        n += 1\n"
            "except OSError as e:\n    print(n, flush=True)\ntime.sleep(60)\n")
    r = run_python(code, timeout_s=2.0, max_processes=16)
    assert r.timed_out
    assert int(r.stdout.split()[0]) <= 16  # RLIMIT_NPROC of the sandbox's own uid: itself + 15 children
    assert processes_with(marker) == []


@pytest.mark.parametrize("detach", [False, True], ids=["child", "setsid-double-fork"])
def test_leftover_processes_are_killed_when_the_program_exits(detach):
    marker = f"leftover-{uuid.uuid4().hex}"
    r = run_python(sleeper_code(marker, detach), timeout_s=5.0)
    assert r.exit_code == 0 and not r.timed_out
    assert processes_with(marker) == []


@pytest.mark.parametrize("detach", [False, True], ids=["child", "setsid-double-fork"])
def test_leftover_processes_are_killed_at_the_deadline(detach):
    marker = f"deadline-{uuid.uuid4().hex}"
    r = run_python(sleeper_code(marker, detach) + "import time\ntime.sleep(60)\n", timeout_s=1.5)
    assert r.timed_out
    assert processes_with(marker) == []


def test_network_connection_to_a_local_server_fails():
    accepted = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    accepted.append(server.accept()[0])
                except TimeoutError:
                    continue

        thread = threading.Thread(target=accept)
        thread.start()
        try:
            code = (f"import socket\nfor family, addr in ((socket.AF_INET, ('127.0.0.1', {port})),):\n"
                    "    s = socket.socket(family)\n    s.settimeout(2)\n    s.connect(addr)\n    s.sendall(b'hi')\n"
                    "print('connected')")
            udp = f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))"
            tcp_r, udp_r = run_python(code), run_python(udp)
        finally:
            stop.set()
            thread.join()
    assert tcp_r.exit_code == 1 and "connected" not in tcp_r.stdout
    assert udp_r.exit_code == 1 and "Network is unreachable" in udp_r.stderr  # no interface but a down loopback
    assert accepted == []


def test_reads_world_readable_files_but_writes_only_in_its_directory(tmp_path):
    name = f"escape-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", str(tmp_path / name), f"/{name}"]
    code = "import os\nprint(open('/etc/passwd').read().count(':') > 0)\nopen('mine.txt', 'w').write('ok')\n"
    code += f"print(open('mine.txt').read())\nfor path in {targets!r}:\n"
    code += "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n    except OSError as e:\n"
    code += "        print('denied', e.errno)\n"
    r = run_python(code)
    assert r.exit_code == 0 and r.stdout.startswith("True\nok\n")
    assert "WROTE" not in r.stdout and r.stdout.count("denied") == len(targets)
    assert not any(os.path.exists(t) for t in targets)


def test_environment_is_empty(monkeypatch):
    monkeypatch.setenv("VCPO_TEST_SECRET", "hunter2")
    r = run_python("import os, subprocess\nprint(dict(os.environ))\nsubprocess.run(['/usr/bin/env'])")
    assert r.exit_code == 0
    assert "hunter2" not in r.stdout and r.stdout == "{}\n"  # `env` in a child prints nothing either


def test_one_hundred_megabytes_of_output_is_capped_fast():
    start = time.perf_counter()
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\nprint('done', file=sys.stderr)"
    r = run_python(code, output_limit_bytes=4096, timeout_s=30)
    assert r.exit_code == 0 and r.stdout_truncated and r.stdout == "x" * 4096 and r.stderr == "done\n"
    assert time.perf_counter() - start < 10  # measured ~0.5 s; the point is that it neither blocks nor hangs


def test_huge_file_is_stopped_by_the_file_size_limit():
    r = run_python("f = open('big', 'wb')\nfor _ in range(100):\n    f.write(b'x' * 2**20)\n    f.flush()",
                   max_file_mb=4)
    assert r.exit_code == 1 and "File too large" in r.stderr


def test_deep_recursion_is_contained():
    r = run_python("import sys\nsys.setrecursionlimit(10**6)\ndef f(n):\n    return f(n + 1) + 1\nf(0)", timeout_s=1.5)
    assert r.timed_out or r.exit_code != 0  # RecursionError, MemoryError, a crash or the deadline: all inside


def test_signal_pause_hits_the_deadline():
    r = run_python("import signal\nsignal.pause()", timeout_s=1.0)
    assert r.timed_out and r.exit_code is None


def test_reading_stdin_gets_eof():
    r = run_python("import sys\nprint(repr(sys.stdin.read()))")
    assert r.stdout == "''\n"


def test_import_and_mro_tricks_reach_only_the_sandbox():
    marker = f"pwned-{uuid.uuid4().hex}"
    code = ("wrap = [c for c in ().__class__.__mro__[1].__subclasses__() if c.__name__ == '_wrap_close'][0]\n"
            "system = wrap.__init__.__globals__['system']\n"
            f"system('id -u; touch /tmp/{marker}')\n"
            f"__import__('os').system('id -u > /dev/shm/{marker}')\n")
    r = run_python(code)
    uid = int(r.stdout.split()[0])
    assert uid != 0 and uid != os.getuid()  # the shell ran, as the sandbox's own unprivileged uid
    assert not os.path.exists(f"/tmp/{marker}") and not os.path.exists(f"/dev/shm/{marker}")


def test_killing_the_parent_or_a_neighbour_fails():
    neighbour = subprocess.Popen(["sleep", "30"])
    try:
        code = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, {neighbour.pid}, 1):\n"
                "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n"
                "        print(type(e).__name__)\n")
        r = run_python(code)
        time.sleep(0.1)
        assert neighbour.poll() is None  # still alive, and so is this test process
    finally:
        neighbour.kill()
        neighbour.wait()
    assert r.exit_code == 0


def test_open_file_exhaustion_is_capped():
    r = run_python("fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\n"
                   "except OSError as e:\n    print(len(fs), e.errno)", max_open_files=32)
    count, errno = map(int, r.stdout.split())
    assert count < 32 and errno == 24  # EMFILE


def test_thread_bomb_is_capped():
    r = run_python("import threading, time\nn = 0\ntry:\n    while True:\n"
                   "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
                   "except RuntimeError:\n    print(n)", timeout_s=5, max_processes=16)
    assert r.exit_code == 0 and int(r.stdout) < 16


def test_mounting_or_raising_limits_is_refused():
    code = ("import resource, subprocess\n"
            "print(subprocess.run(['mount', '-t', 'tmpfs', 'x', '/mnt'], capture_output=True).returncode)\n"
            "try:\n    resource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))\nexcept ValueError:\n"
            "    print('refused')")
    r = run_python(code)
    assert r.stdout.split() == ["32", "refused"]  # mount: permission denied (32 = mount's failure status)


def test_isolation_is_reported_and_complete_as_root():
    r = run_python("pass")
    if os.geteuid() != 0:
        pytest.skip("the full set needs root (docs/sandbox.md: the fallback)")
    for layer in ("pid-namespace", "net-namespace", "mount-namespace", "read-only-filesystem", "unprivileged-uid",
                  "rlimits"):
        assert layer in r.isolation


def test_many_threads_at_once_get_their_own_results():
    results: dict[int, str] = {}

    def one(i: int) -> None:
        results[i] = run_python(f"import time\ntime.sleep(0.05)\nprint({i} * {i})").stdout

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i * i}\n" for i in range(8)}


def test_no_working_directories_are_left_behind(monkeypatch):
    import shutil
    import tempfile

    # A private temporary root (other processes on the machine may run sandboxes of their own), which the
    # sandbox's unprivileged user can traverse as it can /tmp: pytest's own tmp_path is private to its user.
    root = tempfile.mkdtemp(prefix="vcpo-test-tmp-")
    os.chmod(root, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", root)
    try:
        run_python("open('x', 'w').write('y')")
        run_python("while True: pass", timeout_s=0.5)
        assert os.listdir(root) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
