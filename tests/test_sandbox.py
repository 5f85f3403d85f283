"""run_python's contract (API.md §5): results, argument errors, and the fallback without namespaces."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from vcpo.envs import landlock
from vcpo.envs.isolation import Limits
from vcpo.envs.sandbox import SandboxResult, run_python

from conftest import processes_with, sleeper_code


def test_prints_and_exit_codes():
    r = run_python("import sys\nprint(1 + 1)\nprint('warn', file=sys.stderr)\nsys.exit(3)")
    assert isinstance(r, SandboxResult)
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("2\n", "warn\n", 3, False)


def test_an_exception_gives_a_traceback_of_the_program_only():
    r = run_python("def f():\n    raise KeyError('k')\nf()")
    assert r.exit_code == 1
    assert r.stderr.startswith("Traceback (most recent call last):\n  File \"<sandbox>\", line 3")
    assert "jail.py" not in r.stderr and r.stderr.endswith("KeyError: 'k'\n")


def test_syntax_error_and_null_bytes_are_the_programs_problem():
    assert "SyntaxError" in run_python("def (:").stderr
    r = run_python("print(1)\x00")
    assert r.exit_code == 1 and "null bytes" in r.stderr


def test_working_directory_is_private_and_writable():
    r = run_python("import os\nopen('a.txt', 'w').write('hello')\nprint(os.listdir('.'), open('a.txt').read())")
    assert r.stdout == "['a.txt'] hello\n"


@pytest.mark.parametrize(("kwargs", "culprit"), [
    ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": -1.0}, "timeout_s"), ({"timeout_s": "5"}, "timeout_s"),
    ({"memory_mb": 0}, "memory_mb"), ({"memory_mb": 1.5}, "memory_mb"), ({"max_processes": 0}, "max_processes"),
    ({"max_file_mb": -1}, "max_file_mb"), ({"max_open_files": 2}, "max_open_files"), ({"cpu_s": 0}, "cpu_s"),
    ({"output_limit_bytes": -1}, "output_limit_bytes"),
])
def test_invalid_arguments_raise_value_error_naming_them(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        run_python("print(1)", **kwargs)


def test_code_must_be_text():
    with pytest.raises(ValueError, match="code"):
        run_python(b"print(1)")  # type: ignore[arg-type]


def test_limits_defaults_are_valid():
    assert Limits().memory_mb == 512 and Limits().cpu_s is None


# The fallback: no namespaces (what a container without CAP_SYS_ADMIN or a user without user namespaces gets).

def test_fallback_runs_and_reports_what_is_in_force():
    r = run_python("print('ok')", namespaces=False)
    assert r.stdout == "ok\n" and "rlimits" in r.isolation
    assert not {"pid-namespace", "net-namespace", "mount-namespace"} & set(r.isolation)


@pytest.mark.parametrize("detach", [False, True], ids=["child", "setsid-double-fork"])
def test_fallback_still_kills_leftovers(detach):
    marker = f"fallback-{uuid.uuid4().hex}"
    r = run_python(sleeper_code(marker, detach) + "import time\ntime.sleep(60)\n", namespaces=False, timeout_s=1.5)
    assert r.timed_out
    assert processes_with(marker) == []  # the supervisor is a subreaper: escaped orphans come back to it


@pytest.mark.skipif(landlock.abi_version() < 6, reason="needs Landlock ABI 6 (Linux 6.12): TCP and signal scoping")
def test_fallback_blocks_writes_tcp_and_signals_with_landlock(tmp_path):
    neighbour = subprocess.Popen(["sleep", "30"])
    target = tmp_path / "outside.txt"
    try:
        code = (f"import os, socket\nfor act in (lambda: open({str(target)!r}, 'w'),\n"
                "            lambda: socket.create_connection(('127.0.0.1', 9), timeout=1),\n"
                f"            lambda: os.kill({neighbour.pid}, 9)):\n"
                "    try:\n        act()\n        print('allowed')\n    except OSError as e:\n"
                "        print(type(e).__name__)\n")
        r = run_python(code, namespaces=False)
        assert neighbour.poll() is None
    finally:
        neighbour.kill()
        neighbour.wait()
    assert not target.exists()
    assert r.stdout.split() == ["PermissionError"] * 3
