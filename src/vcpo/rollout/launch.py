"""Inference servers that ``vcpo train`` starts and stops itself (``rollout.server.launch``): each on 127.0.0.1 and a
free port, with the flags that make its log-probs the learner's, healthy before the first rollout, and gone however
the trainer ends (each runs under a ``vcpo.guard`` process that ends its whole tree).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from vcpo.config import LaunchConfig
from vcpo.rollout.server_pool import ServerError
from vcpo.runtime import set_parent_death_signal

HOST = "127.0.0.1"  # the dev-mode routes (/collective_rpc) have no authentication: never another interface
STOP_GRACE_S = 15.0  # a server's own shutdown on SIGTERM, before its group is killed
LOG_TAIL_LINES = 30


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for ``--max-lora-rank`` (an adapter of any rank up to it is served; the config
refuses a rank above the largest)."""


def server_command(kind: str, python: str, model_dir: str | Path, port: int, dtype: str,
                   extra_args: list[str], lora_rank: int = 0) -> list[str]:
    """The start command of one server of ``kind`` (docs/server.md): vLLM with the learner's dtype and processed
    log-probs (those of the distribution sampled, after temperature and top-p), and for a LoRA run (``lora_rank``
    above 0) adapters up to that rank, two at once (the current version's and the one before); or `vcpo serve`
    (which builds the adapters from each version's ``adapter_config.json``)."""
    dtype = "float32" if dtype == "float64" else dtype  # vLLM computes in float32 at most
    if kind == "vllm":
        base = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", HOST,
                "--port", str(port), "--dtype", dtype, "--logprobs-mode", "processed_logprobs"]
        if lora_rank > 0:
            max_rank = next(r for r in VLLM_LORA_RANKS if r >= lora_rank)  # config: rank 512 at most
            base += ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "2"]
    elif kind == "vcpo":
        base = [python, "-m", "vcpo.cli", "serve", str(model_dir), "--host", HOST, "--port", str(port),
                "--dtype", dtype]
    else:
        raise ValueError(f"rollout.server.launch cannot start {kind!r} servers (vllm or vcpo)")
    return base + list(extra_args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _guard_preexec() -> None:
    set_parent_death_signal(signal.SIGTERM)  # the guard ends the server's tree when the trainer dies


class LaunchedServers:
    """``launch.num_servers`` servers of ``kind`` on ``model_dir``, each under a guard in its own process group, its
    output in ``log_dir/server{i}.log``. ``start`` returns at once; ``wait_healthy`` waits for ``/health``; ``stop``
    (also the context manager's exit) ends every tree. Start it from the main thread: the parent-death signal
    follows the thread that forks."""

    def __init__(self, launch: LaunchConfig, kind: str, model_dir: str | Path, dtype: str, log_dir: str | Path,
                 lora_rank: int = 0) -> None:
        self.launch, self.kind, self.lora_rank = launch, kind, lora_rank
        self.model_dir, self.dtype = model_dir, dtype
        self.log_dir = Path(log_dir)
        self.urls: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self._files: list[IO[bytes]] = []

    def start(self) -> LaunchedServers:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.launch.env}
        if self.kind == "vllm":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc (bound to 127.0.0.1 only)
            if self.lora_rank > 0:
                env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        python = self.launch.python or sys.executable
        for i in range(self.launch.num_servers):
            port = free_port()
            command = server_command(self.kind, python, self.model_dir, port, self.dtype, self.launch.extra_args,
                                     self.lora_rank)
            log_path = self.log_dir / f"server{i}.log"
            log = open(log_path, "wb")  # a file, not a pipe: a chatty server never blocks on it
            self._files.append(log)
            guard = [sys.executable, "-m", "vcpo.guard", str(os.getpid()), str(STOP_GRACE_S), "--", *command]
            try:
                proc = subprocess.Popen(guard, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True, preexec_fn=_guard_preexec)
            except OSError as exc:
                self.stop()
                raise ServerError(f"cannot start rollout server {i} ({command[0]}): {exc}") from None
            self.procs.append(proc)
            self.logs.append(log_path)
            self.urls.append(f"http://{HOST}:{port}")
        return self

    def wait_healthy(self) -> list[str]:
        """Block until every server answers ``/health`` with 200; a server that exits or stays silent past
        ``startup_timeout_s`` stops everything, prints its log's tail on stderr and raises one line naming it."""
        deadline = time.monotonic() + self.launch.startup_timeout_s
        for i, (url, proc) in enumerate(zip(self.urls, self.procs, strict=True)):
            while True:
                if proc.poll() is not None:
                    self._fail(i, "exited during startup")
                try:
                    if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self._fail(i, f"did not answer /health within {self.launch.startup_timeout_s:g} s "
                                  f"(rollout.server.launch.startup_timeout_s)")
                time.sleep(0.5)
        return list(self.urls)

    def _fail(self, i: int, what: str) -> None:
        self.stop()
        print(f"--- the last lines of {self.logs[i]} ---\n{self.log_tail(i)}\n---", file=sys.stderr)
        raise ServerError(f"launched rollout server {i} ({self.kind}, {self.urls[i]}) {what}; its log: {self.logs[i]}")

    def log_tail(self, i: int, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.logs[i].read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to each guard's group (the guard gives its server ``STOP_GRACE_S`` to exit), then SIGKILL to each
        group: nothing of any server tree is left when this returns."""
        for proc in self.procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S + 5.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs.clear()
        for f in self._files:
            f.close()
        self._files.clear()

    def __enter__(self) -> LaunchedServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
