"""Shared test helpers: tiny batches built from explicit numbers; the command line in a child process;
finding processes a sandbox left behind."""

from __future__ import annotations

import math
import os
import subprocess
import sys
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

# A small Jinja chat template in the style of ChatML, written with characters of the embedded tokenizer.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

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
