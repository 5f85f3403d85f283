"""What a step's groups looked like before the source chose among them: the response length and per-prompt pass rate
of the groups generated, trained and dropped (for staleness or by dynamic sampling), so that an admission or
filtering rule's bias on the trained distribution shows in the metrics (``groups/*``)."""

from __future__ import annotations

from vcpo.types import Trajectory, is_dropped_group

KINDS = ("trained", "dropped")


def group_length(group: list[Trajectory]) -> float:
    """The group's mean response length in model tokens (observations left out)."""
    return sum(sum(t.model_token_mask()) for t in group) / len(group)


def group_pass_rate(group: list[Trajectory]) -> float:
    """The prompt's pass rate in this group: its responses' mean reward (the fraction correct for 0/1 rewards)."""
    return sum(t.reward for t in group) / len(group)


class GroupTally:
    """The groups a source handled since its last ``take``, each ``trained`` or ``dropped``."""

    def __init__(self) -> None:
        self.groups: dict[str, list[list[Trajectory]]] = {kind: [] for kind in KINDS}

    def add(self, group: list[Trajectory], kind: str) -> None:
        """Count ``group`` as ``kind``; an agent task's dropped-group marker is not a generated group (it is counted in
        ``agent/dropped_groups``)."""
        if not is_dropped_group(group):
            self.groups[kind].append(group)

    def take(self) -> dict[str, float]:
        """The step's ``groups/{generated,trained,dropped}`` (generated: both), ``..._count`` and, over the groups of
        each (every group weighs one prompt), ``..._length_mean`` and ``..._pass_rate``; a kind with no group has only
        its count. Starts the next step's tally."""
        by_kind = self.groups | {"generated": self.groups["trained"] + self.groups["dropped"]}
        out: dict[str, float] = {}
        for kind, groups in by_kind.items():
            out[f"groups/{kind}_count"] = float(len(groups))
            if groups:
                out[f"groups/{kind}_length_mean"] = sum(map(group_length, groups)) / len(groups)
                out[f"groups/{kind}_pass_rate"] = sum(map(group_pass_rate, groups)) / len(groups)
        self.groups = {kind: [] for kind in KINDS}
        return out
