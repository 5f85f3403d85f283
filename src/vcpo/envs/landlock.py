"""Linux Landlock through ctypes (stdlib only, loaded by ``jail.py``): writes only beneath the working
directory, no TCP bind or connect, no signals to processes outside the sandbox.

Landlock (Linux 5.13+) works without privileges, so it holds in the fallback where namespaces are not
allowed. What it can restrict grows with the kernel's ABI version: 1-3 the filesystem, 4 TCP, 6 signals
and abstract Unix sockets. ``restrict`` applies what the running kernel supports and says which.
"""

from __future__ import annotations

import ctypes
import os
import struct

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on x86-64 and arm64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_FS_WRITE_FILE = 1 << 1
_FS_WRITES_ABI1 = (
    _FS_WRITE_FILE
    | (1 << 4) | (1 << 5)  # remove dir, remove file
    | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)  # make char..symlink
)
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2  # ABI 4
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2  # ABI 6
_WRITABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is absent or disabled."""
    version = _libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0),
                            ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def restrict(workdir: str) -> list[str]:
    """Restrict this process (and its future children) for good; returns the layers applied.

    Needs ``PR_SET_NO_NEW_PRIVS`` (or CAP_SYS_ADMIN). Reading and executing stay allowed everywhere (the
    interpreter needs its files; what may be read is the other layers' concern).
    """
    abi = abi_version()
    if abi < 1:
        return []
    fs = _FS_WRITES_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _syscall(_SYS_CREATE_RULESET, ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    try:
        _allow(ruleset, workdir, fs)
        file_rights = _FS_WRITE_FILE | (_FS_TRUNCATE if abi >= 3 else 0)
        for device in _WRITABLE_DEVICES:
            if os.path.exists(device):
                _allow(ruleset, device, file_rights)
        _syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    applied = ["landlock-filesystem"]
    if net:
        applied.append("landlock-tcp")
    if scoped:
        applied.append("landlock-signals")
    return applied


def _allow(ruleset: int, path: str, rights: int) -> None:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        rule = struct.pack("=Qi", rights, fd)  # struct landlock_path_beneath_attr is packed: 12 bytes
        _syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.c_char_p(rule),
                 ctypes.c_uint32(0))
    finally:
        os.close(fd)


def _syscall(number: int, *args) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock syscall {number}: {os.strerror(err)}")
    return int(result)
