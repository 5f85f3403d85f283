"""The server engine: ``RolloutEngine`` over HTTP inference servers, token in and token out, with the
abort-and-continue loop that carries a response across a weight update, one version tag per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vcpo.config import ServerConfig
from vcpo.rollout.engine import RolloutError, WeightPoll, _check_request
from vcpo.rollout.server_kinds import ServerResponseError
from vcpo.rollout.server_pool import ServerDown, ServerError, ServerPool
from vcpo.rollout.weights import WeightPublisher, write_weights_dir
from vcpo.types import Generation, SamplingParams


@dataclass
class _Row:
    """One prompt's response as it grows across calls (a call ends early when a pause aborts it)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    finished: bool = False


class ServerWeightPublisher:
    """``WeightPublisher`` through the disk: a safetensors directory per version under ``root`` (the newest
    ``keep_last`` kept), then each live server of ``pool`` pauses, loads it and resumes.

    ``abort`` chooses what a pause does to in-flight requests: abort them (they continue under the new weights,
    ``async.inflight_updates``) or let them finish under the old ones first.
    """

    def __init__(self, pool: ServerPool, root: str | Path, keep_last: int = 2, extra_files: Sequence[str | Path] = (),
                 abort: bool = True) -> None:
        self.pool = pool
        self.root = Path(root)
        self.keep_last = keep_last
        self.extra_files = list(extra_files)
        self.abort = abort

    def publish(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        path = write_weights_dir(self.root, state_dict, version, self.keep_last, self.extra_files)
        self.pool.update_all(str(path.resolve()), version, abort=self.abort)


class ServerRolloutEngine:
    """``RolloutEngine`` whose forward passes run on ``pool``'s servers; prompts are spread over the live ones.

    Each prompt's response is driven by the abort-and-continue loop: a call that a pause cut short
    (``finish_reason="abort"``) is sent again as prompt + tokens so far with the remaining budget, so the rest is
    sampled, and its log-probs computed, under the new weights. Servers that tag tokens (`vcpo serve`) give each
    token its version; for the others every token of a call gets ``version_of()`` read when the call was sent
    (a weight update aborts the calls in flight, so a call's tokens come from one version; one queued through a
    whole update is tagged one version too old, which errs on the safe side of the staleness bound). A server
    that goes down mid-generation hands its unfinished rows, tokens so far included, to the others.
    """

    def __init__(self, pool: ServerPool, publisher: WeightPublisher | None = None, version: int = 0,
                 version_of: Callable[[], int] | None = None) -> None:
        self.pool = pool
        self.publisher = publisher
        self.version = version
        self.version_of = version_of or (lambda: self.version)

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Publish ``state_dict`` to every server as ``version`` (pause, update, resume); blocks until done."""
        if self.publisher is None:
            raise RolloutError("this server engine has no weight publisher: the process that owns one publishes")
        self.publisher.publish(state_dict, version)
        self.version = version

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        *,
        weight_poll: WeightPoll | None = None,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> list[Generation]:
        """Sample a response per prompt on the servers; log-probs are those of the distribution sampled
        (temperature and top-p applied). ``weight_poll`` and ``generator`` have no meaning here: weights reach the
        servers through ``load_weights``, and the servers draw their own random numbers."""
        _check_request(prompt_ids, sampling)
        rows = [_Row(list(p), done=sampling.max_new_tokens == 0) for p in prompt_ids]
        todo = [i for i, row in enumerate(rows) if not row.done]
        while todo:
            live = self.pool.live()
            chunks = [todo[i :: len(live)] for i in range(len(live))]
            with ThreadPoolExecutor(len(live)) as executor:
                futures = [executor.submit(self._drive, url, [rows[i] for i in chunk], sampling, greedy)
                           for url, chunk in zip(live, chunks, strict=True) if chunk]
            for f in futures:
                if f.exception() is not None and not isinstance(f.exception(), ServerDown):
                    raise f.exception()
            todo = [i for i in todo if not rows[i].done]
        return [Generation(response_ids=r.tokens, behavior_logprobs=r.logprobs, versions=r.versions,
                           finished=r.finished) for r in rows]

    def _drive(self, url: str, rows: list[_Row], sampling: SamplingParams, greedy: bool) -> None:
        """Call ``url`` until every row is done; rows with the same remaining budget share a call."""
        api = self.pool.api
        while active := [r for r in rows if not r.done]:
            budget = sampling.max_new_tokens - len(active[0].tokens)
            group = [r for r in active if sampling.max_new_tokens - len(r.tokens) == budget]
            version = self.version_of()
            body = self.pool.call(url, api.generate([r.prompt + r.tokens for r in group], sampling, budget, greedy))
            try:
                segments = api.parse(body, len(group))
            except ServerResponseError as exc:
                raise ServerError(f"rollout server {url} ({api.kind}): {exc}") from None
            for row, seg in zip(group, segments, strict=True):
                row.tokens += seg.token_ids
                row.logprobs += seg.logprobs
                row.versions += seg.versions if seg.versions is not None else [version] * len(seg.token_ids)
                if seg.finish_reason != "abort" or len(row.tokens) >= sampling.max_new_tokens:
                    row.done = True
                    row.finished = seg.finish_reason == "stop"


def server_engine(server: ServerConfig, *, weights_dir: str | Path | None = None,
                  extra_files: Sequence[str | Path] = (), abort: bool = True,
                  version_of: Callable[[], int] | None = None) -> ServerRolloutEngine:
    """The engine of ``rollout.server``; with ``weights_dir`` it also publishes weights (the learner's process),
    without it only generates (an async rollout worker: ``version_of`` then reads the published version)."""
    pool = ServerPool(server.urls, server.kind, model=server.model, connect_timeout_s=server.connect_timeout_s,
                      request_timeout_s=server.request_timeout_s, control_timeout_s=server.control_timeout_s,
                      retries=server.retries, retry_backoff_s=server.retry_backoff_s)
    publisher = None if weights_dir is None else ServerWeightPublisher(pool, weights_dir, server.keep_weights,
                                                                      extra_files, abort)
    return ServerRolloutEngine(pool, publisher, version=-1, version_of=version_of)
