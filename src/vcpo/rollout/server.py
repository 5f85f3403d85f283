"""The server engine: ``RolloutEngine`` over HTTP inference servers, token in and token out, with the
abort-and-continue loop that carries a response across a weight update, one version tag per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vcpo.config import ServerConfig
from vcpo.models.lora import ADAPTER_WEIGHTS, peft_state_dict
from vcpo.rollout.engine import RolloutError, WeightPoll, _check_request
from vcpo.rollout.server_kinds import ServerResponseError
from vcpo.rollout.server_pool import ServerDown, ServerError, ServerPool
from vcpo.rollout.weights import WeightPublisher, distinct_tensors, write_weights_dir
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


class WeightCheck:
    """What a server must answer after an update: the log-prob of each token of a fixed sequence given the ones
    before it, as the learner's weights give it (max absolute difference at most ``tol``). A server that kept some
    old weights (a tied tensor the update did not reach, an update route that silently did nothing) or computes in
    another dtype fails it, where training would only drift."""

    def __init__(self, model: torch.nn.Module, token_ids: Sequence[int], tol: float) -> None:
        self.model = model
        self.token_ids = [int(t) for t in token_ids]
        self.tol = tol

    @staticmethod
    def probe(vocab_size: int, length: int = 16, seed: int = 0) -> list[int]:
        """A fixed sequence of ``length`` token ids drawn uniformly from ``[0, vocab_size)``."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (length,), generator=g).tolist()

    def expected(self, state_dict: Mapping[str, Tensor]) -> list[float]:
        """log p(token_t | tokens_<t) for t >= 1 under ``state_dict`` loaded into the learner's model."""
        ids = torch.tensor([self.token_ids], device=next(self.model.parameters()).device)
        weights = dict(distinct_tensors(state_dict))  # one name per tied tensor: functional_call ties the rest
        with torch.no_grad():
            logits = torch.func.functional_call(self.model, weights, (ids,)).logits[0].float()
        logp_T_V = torch.log_softmax(logits, dim=-1)
        return logp_T_V[:-1].gather(1, ids[0, 1:, None]).squeeze(1).tolist()


class ServerWeightPublisher:
    """``WeightPublisher`` through the disk: a safetensors directory per version under ``root`` (the newest
    ``keep_last`` kept), then each live server of ``pool`` pauses, loads it and resumes; with ``check``, each server
    then scores ``check``'s sequence and a server that does not serve the learner's weights stops the run.

    ``abort`` chooses what a pause does to in-flight requests: abort them (they continue under the new weights,
    ``async.inflight_updates``) or let them finish under the old ones first.
    """

    def __init__(self, pool: ServerPool, root: str | Path, keep_last: int = 2, extra_files: Sequence[str | Path] = (),
                 abort: bool = True, check: WeightCheck | None = None) -> None:
        self.pool = pool
        self.root = Path(root)
        self.keep_last = keep_last
        self.extra_files = list(extra_files)
        self.abort = abort
        self.check = check
        self.last_check_gap: float | None = None

    def publish(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        if self.pool.api.peft_layout:
            path = write_weights_dir(self.root, peft_state_dict(state_dict), version, self.keep_last,
                                     self.extra_files, ADAPTER_WEIGHTS)
        else:
            path = write_weights_dir(self.root, state_dict, version, self.keep_last, self.extra_files)
        self.pool.update_all(str(path.resolve()), version, abort=self.abort)
        if self.check is not None:
            self.verify(state_dict, version)

    def verify(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Every live server scores the check's sequence within ``tol`` of ``state_dict``'s log-probs, else one
        ``ServerError`` line naming the server and the gap (servers that do not answer are down, as anywhere)."""
        call = self.pool.api.score(self.check.token_ids, version)
        if call is None:  # the kind cannot score a sequence (vcpo serve checks keys and shapes itself; SGLang)
            return
        expected = self.check.expected(state_dict)
        gaps = []
        for url in self.pool.live():
            try:
                body = self.pool.call(url, call, self.pool.control_timeout_s)
            except ServerDown:
                continue
            try:
                got = self.pool.api.parse_score(body, self.check.token_ids)
            except ServerResponseError as exc:
                raise ServerError(f"rollout server {url} ({self.pool.api.kind}) weight check: {exc}") from None
            gap = max(abs(a - b) for a, b in zip(got, expected, strict=True))
            if not gap <= self.check.tol:
                raise ServerError(
                    f"rollout server {url} does not serve the learner's weights after the update to version {version}:"
                    f" its log-probs of a fixed {len(self.check.token_ids)}-token sequence differ by up to {gap:.3g} "
                    f"(rollout.server.weight_check_tol={self.check.tol:g}); start it with the learner's dtype and "
                    f"check that its update route reloads every tensor")
            gaps.append(gap)
        self.last_check_gap = max(gaps, default=None)


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
        """Call ``url`` until every row is done. Rows with the same remaining budget share a call; after an abort,
        rows left with different budgets continue as concurrent calls, one per budget."""
        api = self.pool.api
        while active := [r for r in rows if not r.done]:
            by_budget: dict[int, list[_Row]] = {}
            for r in active:
                by_budget.setdefault(sampling.max_new_tokens - len(r.tokens), []).append(r)
            if len(by_budget) > 1:
                with ThreadPoolExecutor(len(by_budget)) as executor:
                    futures = [executor.submit(self._drive, url, group, sampling, greedy)
                               for group in by_budget.values()]
                _raise_first(futures)
                return
            (budget, group), = by_budget.items()
            version = self.version_of()
            body = self.pool.call(url, api.generate([r.prompt + r.tokens for r in group], sampling, budget, greedy,
                                                    version))
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


def _raise_first(futures: list[Future]) -> None:
    """Re-raise the first error of ``futures`` that is not ``ServerDown``, else the first ``ServerDown``."""
    errors = [f.exception() for f in futures if f.exception() is not None]
    hard = [e for e in errors if not isinstance(e, ServerDown)]
    if hard or errors:
        raise (hard or errors)[0]


def server_engine(server: ServerConfig, *, weights_dir: str | Path | None = None,
                  extra_files: Sequence[str | Path] = (), abort: bool = True,
                  version_of: Callable[[], int] | None = None, check: WeightCheck | None = None,
                  lora: bool = False) -> ServerRolloutEngine:
    """The engine of ``rollout.server``; with ``weights_dir`` it also publishes weights (the learner's process) and
    checks each update with ``check``, without it only generates (an async rollout worker: ``version_of`` then reads
    the published version). ``lora``: each version is a LoRA adapter's tensors (vLLM loads it as an adapter)."""
    pool = ServerPool(server.urls, server.kind, model=server.model, lora=lora,
                      connect_timeout_s=server.connect_timeout_s, request_timeout_s=server.request_timeout_s,
                      control_timeout_s=server.control_timeout_s,
                      retries=server.retries, retry_backoff_s=server.retry_backoff_s)
    publisher = None if weights_dir is None else ServerWeightPublisher(pool, weights_dir, server.keep_weights,
                                                                      extra_files, abort, check)
    return ServerRolloutEngine(pool, publisher, version=-1, version_of=version_of)
