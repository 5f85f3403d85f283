"""In which order finished rollout groups reach a step (``async.batch_order``): as they arrive, or in the order the
staleness bound admitted them.

Arrival order lets a fast group overtake a slow one; the slow one (a long response, often a hard prompt) then lags
more by the time a step takes it, and the batch-time check of the bound drops it: on a long-tailed task the trained
groups can come out shorter and easier than the generated ones (the tool task, whose lengths vary little, showed no
such bias: benchmarks/RESULTS.md, length and difficulty). Admission order takes group i
only after every group admitted before it. Then a group's lag at the step that trains it depends only on when it was
admitted, not on how long it took, and with AReaL's admission rule (vcpo.orchestration.staleness) it never exceeds
k: at most ``(k + v + 1) P`` groups are admitted (net of drops) at version v, the step at version s takes groups
in index order after ``s P`` others were trained, so group i, admitted at version v, has ``i - d < (k + v + 1) P``
with d the drops before it and ``i >= s P + d``: ``v > s - k - 1``, its lag ``s - v <= k``.

Either order holds every finished group not yet taken and gives them all to a checkpoint (``groups``); a resumed run
puts the finished ones back and regenerates the unfinished ones. Arrival order takes the finished ones first (they are
there first); admission order takes the indices the checkpoint held, finished or not, in ascending order (``pending``),
then continues at the stream's next index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Literal, Protocol

from vcpo.types import Trajectory

BatchOrder = Literal["arrival", "admission"]


class GroupOrder(Protocol):
    """Finished groups in; the next group a step may take is looked at (``peek``, None: wait for more) before it is
    taken out (``pop``), so that a group is always held somewhere while a step decides on it. ``groups``: every
    group held, in the order they would be taken (what a checkpoint keeps)."""

    def put(self, group: list[Trajectory]) -> None: ...

    def peek(self) -> list[Trajectory] | None: ...

    def pop(self) -> list[Trajectory]: ...

    def groups(self) -> list[list[Trajectory]]: ...

    def waiting_for(self) -> int | None:
        """The group index the next ``peek`` needs, when only that one will do (admission order); else None."""
        ...


class ArrivalOrder:
    """First finished, first taken."""

    def __init__(self) -> None:
        self._queue: deque[list[Trajectory]] = deque()

    def put(self, group: list[Trajectory]) -> None:
        self._queue.append(group)

    def peek(self) -> list[Trajectory] | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> list[Trajectory]:
        return self._queue.popleft()

    def groups(self) -> list[list[Trajectory]]:
        return list(self._queue)

    def waiting_for(self) -> int | None:
        return None


class AdmissionOrder:
    """Group ``next_index`` first, then ``next_index + 1``, ...: a finished group waits for every group admitted
    before it (each index is issued once and always comes back: a restarted worker re-sends what it held, a resumed
    run regenerates what was unfinished). ``pending``: after a resume, the indices below ``next_index`` that were
    admitted and not yet taken (the checkpoint's finished and unfinished groups); they come first, in ascending order,
    and the indices between them were taken before the checkpoint."""

    def __init__(self, next_index: int, pending: Iterable[int] = ()) -> None:
        self.next_index = next_index
        self._pending = deque(sorted({int(i) for i in pending if i < next_index}))
        self._waiting: dict[int, list[Trajectory]] = {}

    def _head(self) -> int:
        return self._pending[0] if self._pending else self.next_index

    def put(self, group: list[Trajectory]) -> None:
        self._waiting[group[0].group_id] = group

    def peek(self) -> list[Trajectory] | None:
        return self._waiting.get(self._head())

    def pop(self) -> list[Trajectory]:
        group = self._waiting.pop(self._head())
        if self._pending:
            self._pending.popleft()
        else:
            self.next_index += 1
        return group

    def groups(self) -> list[list[Trajectory]]:
        return [self._waiting[i] for i in sorted(self._waiting)]

    def waiting_for(self) -> int | None:
        return self._head()


def make_order(order: BatchOrder, next_index: int, pending: Iterable[int] = ()) -> GroupOrder:
    """The order ``async.batch_order`` names. ``next_index``: the first group index the source will issue;
    ``pending``: the indices admitted before a resume and not yet taken (admission order takes them first; arrival
    order takes whatever is put first)."""
    return AdmissionOrder(next_index, pending) if order == "admission" else ArrivalOrder()
