"""Shared test helpers: tiny batches built from explicit numbers; finding processes a sandbox left behind."""

from __future__ import annotations

import math
import os

import torch

from vcpo.objectives import ObjectiveInputs


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
