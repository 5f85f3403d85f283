"""The scheduler behind ``vcpo serve``: pending requests batched into one engine call, on a thread of its own,
with pause (in-flight requests aborted at the next decode step), resume and weight updates between batches.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from vcpo.models.lora import apply_lora_config, is_lora
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.types import Generation, SamplingParams


@dataclass(frozen=True)
class BatchKey:
    """Requests batch together only when they sample from the same distribution with the same budget."""

    temperature: float
    top_p: float
    max_tokens: int
    greedy: bool
    seed: int | None


@dataclass
class Segment:
    """One prompt's answer: the tokens sampled, their log-probs and versions, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # stop (EOS), length (max_tokens) or abort (a pause cut it short)


@dataclass
class _Request:
    prompts: list[list[int]]
    key: BatchKey
    future: Future = field(default_factory=Future)


class WeightsDirError(ValueError):
    """A weights directory that cannot be loaded; the message is one line naming the path and the problem."""


def read_weights_dir(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of the ``*.safetensors`` files in directory ``path`` (one file or shards), on the CPU."""
    p = Path(path)
    if not p.is_dir():
        raise WeightsDirError(f"weights path {str(p)!r} is not a directory")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise WeightsDirError(f"weights path {str(p)!r} holds no *.safetensors file")
    state: dict[str, Tensor] = {}
    for f in files:
        try:
            state |= load_file(f, device="cpu")
        except (SafetensorError, OSError) as exc:
            raise WeightsDirError(f"weights file {str(f)!r} cannot be read: {exc}") from None
    return state


class Batcher:
    """Gathers pending requests and runs them as batched ``HFRolloutEngine.generate`` calls on one thread.

    A batch holds every pending request with the first one's ``BatchKey``; requests arriving meanwhile join
    the next batch. ``pause`` follows vLLM's default mode (``abort``): the running batch stops at its next
    decode step and every unfinished row returns what it has with ``finish_reason="abort"``; vLLM's ``wait``
    lets it finish first. Requests that arrive while paused wait for ``resume``. Weights change only between batches.
    """

    def __init__(self, engine: HFRolloutEngine, seed: int = 0) -> None:
        self.engine = engine
        self.generator = torch.Generator().manual_seed(seed)
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self._engine_lock = threading.Lock()  # held while a batch runs or weights change
        self._paused = False  # no batch starts
        self._abort = False  # the running batch stops at its next decode step
        self._closed = False
        self.batches = 0
        self.generating = False  # a batch is running (for /health)
        self._thread = threading.Thread(target=self._loop, name="vcpo-serve-batcher", daemon=True)
        self._thread.start()

    @property
    def paused(self) -> bool:
        return self._paused

    def submit(self, prompts: list[list[int]], key: BatchKey) -> Future:
        """Queue a request; its future resolves to one ``Segment`` per prompt (or the engine's exception)."""
        request = _Request(prompts, key)
        with self._cond:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._pending.append(request)
            self._cond.notify_all()
        return request.future

    def pause(self, abort: bool = True) -> None:
        """Start no batch; ``abort`` stops the running one at its next decode step, else it runs to its end.
        Returns once no batch is running and the last one's results are delivered."""
        with self._cond:
            self._paused = True
            self._abort = abort
        with self._engine_lock:  # the running batch, if any, has returned its partial rows
            pass

    def resume(self) -> None:
        with self._cond:
            self._paused = self._abort = False
            self._cond.notify_all()

    def update_weights(self, state_dict: Mapping[str, Tensor], version: int,
                       lora: Mapping[str, Any] | None = None) -> None:
        """Load new weights between batches (all checked before any is copied: a rejected update changes nothing).

        ``lora``: the ``model.lora`` settings of an adapter-only update (its directory's ``adapter_config.json``);
        the first such update injects those adapters (zero, so the policy is still the base's) into the served
        model, and from then on every update carries the adapters' tensors alone."""
        with self._engine_lock:
            if lora is not None and not is_lora(self.engine.model):
                apply_lora_config(self.engine.model, dict(lora))
            self.engine.load_weights(state_dict, version)

    def close(self) -> None:
        with self._cond:
            self._closed = self._paused = self._abort = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _take_batch(self) -> list[_Request] | None:
        with self._cond:
            while not self._closed and (self._paused or not self._pending):
                self._cond.wait()
            if self._closed:
                for request in self._pending:
                    request.future.set_exception(RuntimeError("the server is shutting down"))
                self._pending.clear()
                return None
            key = self._pending[0].key
            batch = [r for r in self._pending if r.key == key]
            self._pending = [r for r in self._pending if r.key != key]
            # Taken while the condition is held: a pause either sees this batch running or it never starts.
            self._engine_lock.acquire()
            return batch

    def _loop(self) -> None:
        while (batch := self._take_batch()) is not None:  # the engine lock comes with the batch
            self.generating = True
            try:
                self._deliver(batch)
            finally:  # after the results are set: a pause that waits on the lock sees the batch's futures done
                self.generating = False
                self._engine_lock.release()

    def _deliver(self, batch: list[_Request]) -> None:
        try:
            segments = self._run(batch)
        except Exception as exc:  # the requests get the error; the server keeps serving
            for request in batch:
                request.future.set_exception(exc)
            return
        self.batches += 1
        start = 0
        for request in batch:
            request.future.set_result(segments[start : start + len(request.prompts)])
            start += len(request.prompts)

    def _run(self, batch: list[_Request]) -> list[Segment]:
        key = batch[0].key
        prompts = [p for r in batch for p in r.prompts]
        generator = self.generator if key.seed is None else torch.Generator().manual_seed(key.seed)
        sampling = SamplingParams(temperature=key.temperature if not key.greedy else 1.0, top_p=key.top_p,
                                  max_new_tokens=key.max_tokens)
        generations = self.engine.generate(prompts, sampling, generator=generator, greedy=key.greedy,
                                           stop=lambda: self._abort)
        return [_segment(g, key.max_tokens) for g in generations]


def _segment(g: Generation, max_tokens: int) -> Segment:
    if g.finished:
        reason = "stop"
    elif len(g.response_ids) >= max_tokens:
        reason = "length"
    else:
        reason = "abort"
    return Segment(g.response_ids, g.behavior_logprobs, g.versions, reason)
