"""Shared test helpers: tiny batches built from explicit numbers; `vcpo` through its real command line on a
tiny warm start (cached once per session), one finished lagged run that resume tests compare against, and
finding processes a sandbox left behind."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vcpo.objectives import ObjectiveInputs
from vcpo.testing.faults import command_env

ROOT = Path(__file__).resolve().parents[1]
LAGGED = ["async.mode=lagged", "async.max_staleness=2", "trainer.max_steps=4"]
"""The lagged run of ``lagged_full``: 4 steps, k = 2, evaluations and checkpoints at steps 2 and 4."""


def vcpo(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "vcpo.cli", *args], capture_output=True, text=True,
                          env=command_env(), cwd=ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"vcpo {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_overrides(tmp_path_factory) -> list[str]:
    """Overrides that make any config tiny: a few SFT steps (cached once), small batches."""
    cache = tmp_path_factory.mktemp("cache")
    return [f"sft.cache_dir={cache}", "sft.steps=30", "sft.batch_size=32", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "task.eval_size=16", "trainer.eval_every=2",
            "trainer.checkpoint_every=2", "logging.progress=false", "trainer.lr=1e-3"]


@pytest.fixture(scope="session")
def tiny(tiny_overrides) -> list[str]:
    """A tiny run of configs/quickstart.yaml."""
    return ["-c", "configs/quickstart.yaml", *tiny_overrides]


@pytest.fixture(scope="session")
def lagged_full(tmp_path_factory, tiny) -> Path:
    """An uninterrupted ``LAGGED`` run: the reference that interrupted and resumed runs must reproduce."""
    run_dir = tmp_path_factory.mktemp("lagged") / "full"
    vcpo("train", *tiny, *LAGGED, f"run_dir={run_dir}")
    return run_dir

# One intra-op thread: the tests' tiny models run several times faster single-threaded on the shared 2-core machine
# (measured: 0.08 s instead of 0.75 s per micro-batch equality test, with other jobs running).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _default_denormals():
    """A test that runs the trainer in-process gets its flush-denormal setting (vcpo.runtime.configure_cpu);
    later tests (hypothesis' float strategies among them) expect IEEE subnormals back."""
    yield
    torch.set_flush_denormal(False)


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
