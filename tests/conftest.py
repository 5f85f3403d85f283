"""Shared test helpers: tiny batches built from explicit numbers; the command line in a child process;
finding processes a sandbox left behind."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from vcpo.objectives import ObjectiveInputs

# One intra-op thread: the tests' tiny models run several times faster single-threaded on the shared 2-core machine
# (measured: 0.08 s instead of 0.75 s per micro-batch equality test, with other jobs running).
torch.set_num_threads(1)


def make_inputs(lp, blp, adv, mask=None, **extra) -> tuple[ObjectiveInputs, torch.Tensor]:
    """ObjectiveInputs from nested lists (float64); returns (inputs, the lp leaf for .grad)."""
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    blp_t = torch.tensor(blp, dtype=torch.float64)
    adv_t = torch.tensor(adv, dtype=torch.float64)
    mask_t = torch.ones_like(blp_t) if mask is None else torch.tensor(mask, dtype=torch.float64)
    conv = {}
    for k, v in extra.items():
        if v is None or isinstance(v, torch.Tensor):
            conv[k] = v
        elif k == "group_ids":
            conv[k] = torch.tensor(v, dtype=torch.long)
        else:
            conv[k] = torch.tensor(v, dtype=torch.float64)
    return ObjectiveInputs(logprobs=lp_t, behavior_logprobs=blp_t, advantages=adv_t, mask=mask_t, **conv), lp_t


LN2 = math.log(2.0)

ROOT = Path(__file__).resolve().parents[1]


def vcpo(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m vcpo.cli ARGS`` from the repository root, offline, one thread; raises on failure if ``check``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "vcpo.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"vcpo {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def processes_with(marker: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != b"Z":
            found.append(int(pid))
    return found


def sleeper_code(marker: str, detach: bool) -> str:
    """A program that leaves a 60 s sleeper behind (after setsid and a double fork when ``detach``)."""
    spawn = f'os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])'
    if detach:
        return ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                f"        {spawn}\n    os._exit(0)\nos.wait()\n")
    return f"import os, sys\nif os.fork() == 0:\n    {spawn}\n"


def save_tiny_policy(out: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 32) with the default model's character tokenizer, saved as a Hugging Face
    directory: what `vcpo serve` and `model.path` load in the server tests (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer

    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies (PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(model_dir: Path, count: int = 1, timeout_s: float = 120.0) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """``count`` `vcpo serve` processes on free localhost ports, healthy before the body runs; each is killed when the
    body ends, also when it fails (and dies with the test process if that is killed first)."""
    import httpx

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs: list[tuple[str, subprocess.Popen]] = []
    logs: list = []
    try:
        for _ in range(count):
            port = free_port()
            log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty server can never block on it
            logs.append(log)
            proc = subprocess.Popen([sys.executable, "-m", "vcpo.cli", "serve", str(model_dir), "--port", str(port)],
                                    env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                                    preexec_fn=_die_with_parent)
            procs.append((f"http://127.0.0.1:{port}", proc))
        deadline = time.monotonic() + timeout_s
        for (url, proc), log in zip(procs, logs, strict=True):
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise AssertionError(f"vcpo serve exited ({proc.returncode}): {log.read()[-2000:]!r}")
                try:
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"vcpo serve at {url} not healthy within {timeout_s} s")
                time.sleep(0.2)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
