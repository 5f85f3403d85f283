"""``<run_dir>/trained_groups.jsonl``: which prompts each step trained on, one line per trained group, so that what
the learner saw (and what a resume kept) can be read back against the run's problem stream."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vcpo.errors import DiskError
from vcpo.orchestration.replay import split_groups
from vcpo.orchestration.tally import group_length
from vcpo.train.run_dir import TRAINED_GROUPS_FILE
from vcpo.types import Trajectory


def trained_group_records(trajectories: list[Trajectory], step: int) -> list[dict[str, Any]]:
    """One record per group of a step's batch, in batch order: ``step`` (the optimizer step that trained it),
    ``prompt_index`` (the group's position in the run's problem stream, its ``group_id``), ``version`` (the policy
    version of its oldest token: the one it was generated with) and ``length_mean`` (its responses' mean number of
    model tokens, observations left out)."""
    return [{"step": step, "prompt_index": group[0].group_id, "version": min(t.min_version for t in group),
             "length_mean": group_length(group)} for group in split_groups(trajectories)]


def append_trained_groups(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Append ``records`` to the run's file, flushed and fsync'ed (as each metrics line is)."""
    path = Path(run_dir) / TRAINED_GROUPS_FILE
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise DiskError(path, e) from None
