"""What the endpoint records of each agent episode, and the calls waiting for the rollout engine.

The endpoint (uvicorn's thread) files calls; the collecting thread, which owns the engine, takes them in batches,
answers them and decides when an episode ends. One lock guards it all; no call waits without the collector's say.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

RUNNING, DONE, DROPPED = "running", "done", "dropped"


@dataclass
class Call:
    """One endpoint call as the policy saw it: its prompt ids (after the chat template), the sampled ids with their
    behavior log-probs and versions, and what the next call's splice compares against."""

    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    finished: bool
    spliced: bool
    reply_text: str
    reply_tool_calls: int = 0
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt_text: str | None = None

    @property
    def context_ids(self) -> list[int]:
        """The context after this call: its prompt then every token sampled."""
        return [*self.prompt_ids, *self.response_ids]


@dataclass
class Episode:
    """One agent run: its calls in order, its state (running, done or dropped) and why it was dropped."""

    id: str
    calls: list[Call] = field(default_factory=list)
    state: str = RUNNING
    failure: str | None = None
    late_calls: int = 0
    tool_calls: int = 0


@dataclass
class PendingCall:
    """A call waiting for the engine: the collector sets ``future`` to its ``Generation`` (or an error)."""

    episode_id: str
    prompt_ids: list[int]
    max_tokens: int
    future: Future = field(default_factory=Future)


class EpisodeDropped(Exception):
    """A call of an episode that is no longer running (its agent failed, timed out, or already returned)."""


class EpisodeBook:
    """The episodes of the collection under way, keyed by id, and the queue of calls for the engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._episodes: dict[str, Episode] = {}
        self._pending: list[PendingCall] = []

    def open(self, episode_ids: list[str]) -> None:
        with self._lock:
            self._episodes.update({i: Episode(i) for i in episode_ids})

    def episode(self, episode_id: str) -> Episode | None:
        with self._lock:
            return self._episodes.get(episode_id)

    def last_call(self, episode_id: str) -> Call | None:
        """The episode's latest call; raises EpisodeDropped (counting a late call) when it is not running."""
        with self._lock:
            episode = self._running(episode_id)
            return episode.calls[-1] if episode.calls else None

    def _running(self, episode_id: str) -> Episode:
        episode = self._episodes.get(episode_id)
        if episode is None:
            raise EpisodeDropped(f"episode {episode_id!r} is not part of this run's collection")
        if episode.state != RUNNING:
            episode.late_calls += 1
            reason = f"was dropped: {episode.failure}" if episode.state == DROPPED else "already returned"
            raise EpisodeDropped(f"episode {episode_id!r} {reason}; this call is not answered")
        return episode

    def submit(self, call: PendingCall) -> None:
        with self._lock:
            self._running(call.episode_id)
            self._pending.append(call)
            self._ready.notify_all()

    def record(self, episode_id: str, call: Call, tool_calls: int) -> None:
        """Keep an answered call (before its answer goes back, so the agent's next call sees it)."""
        with self._lock:
            episode = self._running(episode_id)
            episode.calls.append(call)
            episode.tool_calls += tool_calls

    def take(self, timeout_s: float, expected: int) -> list[PendingCall]:
        """The pending calls once ``expected`` are in or ``timeout_s`` passed since the first arrived (a batch)."""
        with self._lock:
            if not self._ready.wait_for(lambda: bool(self._pending), timeout=timeout_s):
                return []
            self._ready.wait_for(lambda: len(self._pending) >= expected, timeout=timeout_s)
            taken, self._pending = self._pending, []
            return taken

    def running(self) -> list[str]:
        with self._lock:
            return [i for i, e in self._episodes.items() if e.state == RUNNING]

    def end(self, episode_id: str, failure: str | None = None) -> None:
        """End an episode (``failure``: why it is dropped); its waiting calls fail with EpisodeDropped."""
        with self._lock:
            episode = self._episodes[episode_id]
            if episode.state != RUNNING:
                return
            episode.state, episode.failure = (DROPPED, failure) if failure else (DONE, None)
            waiting = [c for c in self._pending if c.episode_id == episode_id]
            self._pending = [c for c in self._pending if c.episode_id != episode_id]
        for call in waiting:
            call.future.set_exception(EpisodeDropped(f"episode {episode_id!r} was dropped: {failure}"))

    def close(self, episode_ids: list[str]) -> None:
        """Forget finished episodes; a later call of theirs is refused as not part of the collection."""
        with self._lock:
            for i in episode_ids:
                self._episodes.pop(i, None)

