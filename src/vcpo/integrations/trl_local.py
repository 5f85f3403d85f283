"""TRL's asynchronous GRPO trainer on a CPU: ``LocalRolloutWorker`` (TRL's ``RolloutWorkerProtocol`` on vcpo's
in-process engine, in a thread), ``LocalWeightTransfer`` (TRL's ``WeightTransferProtocol`` into that worker), and the
two stand-ins TRL's trainer needs where CUDA is absent: tree attention in plain PyTorch and an "unknown" peak-FLOPs
answer. ``vcpo.integrations.trl_async`` uses them; docs/integrations.md says what ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedTokenizerBase
from trl.experimental.async_grpo import async_grpo_trainer as trl_async_trainer
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.experimental.async_grpo.packing import TREE_ATTENTION, tree_attention

from vcpo.rollout.engine import HFRolloutEngine
from vcpo.types import Generation, SamplingParams
from vcpo.variance import grpo_advantages

RewardFunc = Callable[..., Sequence[float | None]]


def reference_tree_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
    tree_kv_index: Tensor, tree_cu_seqlens_q: Tensor, tree_cu_seqlens_k: Tensor, tree_max_seqlen_q: int,
    tree_max_seqlen_k: int, scaling: float | None = None, sliding_window: int | None = None,
    softcap: float | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """TRL's tree attention (``packing.tree_attention``: a row of prefix-shared samples, one forward) in plain
    PyTorch on the CPU, where TRL's FlashAttention-3 kernel does not exist; other devices get TRL's kernel.

    Segment s holds packed queries ``cu_q[s]..cu_q[s+1]`` (``L_q`` of them) and attends its root-to-segment path
    ``tree_kv_index[cu_k[s]..cu_k[s+1]]`` (``L_k`` keys, ending with its own tokens), causally aligned at the end:
    query i sees the first ``L_k - L_q + i + 1`` keys of the path. That is one [N, N] boolean mask over the packed
    positions, then ``softmax(q k^T * scaling + mask) v``, grouped-query heads shared as the kernel shares them.
    """
    if query.device.type != "cpu":
        return tree_attention(
            module, query, key, value, attention_mask, tree_kv_index=tree_kv_index,
            tree_cu_seqlens_q=tree_cu_seqlens_q, tree_cu_seqlens_k=tree_cu_seqlens_k,
            tree_max_seqlen_q=tree_max_seqlen_q, tree_max_seqlen_k=tree_max_seqlen_k, scaling=scaling,
            sliding_window=sliding_window, softcap=softcap, **kwargs)
    if sliding_window or softcap:
        raise NotImplementedError("reference_tree_attention: sliding-window and soft-capped attention are not "
                                  "implemented on the CPU")
    n = query.shape[2]
    allowed_NN = torch.zeros(n, n, dtype=torch.bool, device=query.device)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        lq, lk = q1 - q0, k1 - k0
        causal_QK = torch.arange(lk)[None, :] <= (lk - lq + torch.arange(lq))[:, None]
        allowed_NN[q0:q1, tree_kv_index[k0:k1]] = causal_QK.to(query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed_NN[None, None], scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2), None


@contextlib.contextmanager
def unknown_peak_flops_without_cuda() -> Iterator[None]:
    """TRL's trainer looks its device's peak FLOPs up by CUDA device name, which fails without CUDA; here the
    lookup answers TRL's own "unknown" (None: MFU metrics off, throughput metrics kept) while the trainer is built."""
    if torch.cuda.is_available():
        yield
        return
    lookup = trl_async_trainer.get_peak_flops_per_device
    trl_async_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        yield
    finally:
        trl_async_trainer.get_peak_flops_per_device = lookup


def use_reference_tree_attention() -> None:
    """Route TRL's tree attention (``TREE_ATTENTION``) through ``reference_tree_attention`` (TRL's kernel off the
    CPU); TRL's trainer registers its own on construction, so call this after."""
    AttentionInterface.register(TREE_ATTENTION, reference_tree_attention)


class LocalRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` on vcpo's in-process engine (``HFRolloutEngine``), in a thread of the
    trainer's process: the CPU stand-in for TRL's vLLM worker.

    Prompt after prompt of ``train_dataset`` (its ``"prompt"`` column of strings, cycled in order), it samples
    ``num_generations`` completions at ``temperature`` / ``top_p``, scores them with ``reward_funcs`` (called as TRL
    calls them: ``prompts``, ``completions``, ``completion_ids`` and the other columns, as lists; a None is
    unscored, the rewards of the functions are summed, NaN when none scored) and puts one TRL ``RolloutSample`` per
    completion on ``rollout_buffer`` (bounded by ``queue_maxsize``; the worker waits while it is full). A sample
    carries the sampler's per-token log-probs (``old_log_probs``, 0 on prompt tokens) and GRPO advantages (vcpo's
    ``grpo_advantages``; 0 for an unscored row), which TRL's own loss trains on. New weights (from
    ``LocalWeightTransfer``) are applied between decode steps, as vLLM's in-flight updates are; a group's
    ``model_version`` is the oldest version any of its tokens was sampled with. ``prompts_per_batch`` prompts are
    sampled together in one batch (more keep a CPU worker ahead of the trainer); ``metrics_queue`` gets the seconds
    each batch took (``rollout/batch_s``).
    """

    def __init__(
        self, model: str | nn.Module, processing_class: PreTrainedTokenizerBase, train_dataset: Any,
        reward_funcs: RewardFunc | Sequence[RewardFunc], *, num_generations: int = 8,
        max_completion_length: int = 256, temperature: float = 1.0, top_p: float = 1.0, queue_maxsize: int = 64,
        prompts_per_batch: int = 1, seed: int = 0,
    ) -> None:
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, Sequence) else [reward_funcs]
        if not self.reward_funcs or not all(callable(f) for f in self.reward_funcs):
            raise ValueError("LocalRolloutWorker: reward_funcs must be one or more callables")
        if "prompt" not in getattr(train_dataset, "column_names", ()) or len(train_dataset) == 0:
            raise ValueError("LocalRolloutWorker: train_dataset must be a non-empty dataset with a 'prompt' column")
        bad = next((i for i, p in enumerate(train_dataset["prompt"]) if not isinstance(p, str)), None)
        if bad is not None:
            raise ValueError(f"LocalRolloutWorker: prompt {bad} is not a string (conversational prompts are not "
                             "supported)")
        if min(num_generations, max_completion_length, prompts_per_batch) < 1 or queue_maxsize < num_generations:
            raise ValueError("LocalRolloutWorker: num_generations, max_completion_length and prompts_per_batch must "
                             f"be >= 1 and queue_maxsize >= num_generations, got {num_generations}, "
                             f"{max_completion_length}, {prompts_per_batch}, {queue_maxsize}")
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_completion_length)
        policy = AutoModelForCausalLM.from_pretrained(model) if isinstance(model, str) else model
        pad_id = processing_class.pad_token_id
        self.engine = HFRolloutEngine(policy, processing_class.eos_token_id,
                                      processing_class.eos_token_id if pad_id is None else pad_id)
        self.tokenizer, self.dataset, self.num_generations = processing_class, train_dataset, num_generations
        self.prompts_per_batch = prompts_per_batch
        self.rollout_buffer: queue.Queue[RolloutSample] = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue()
        self.generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._staged: dict[str, Tensor] | None = None
        self._pending: tuple[int, dict[str, Tensor]] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.time()

    def start(self) -> None:
        """Start the generation thread (a second call while it runs does nothing)."""
        if self.is_alive():
            return
        self._stopping.clear()
        self._heartbeat = time.time()
        self._thread = threading.Thread(target=self._run, name="vcpo-local-rollout", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the thread after its current decode step and wait for it (it is a daemon thread either way)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stage_weights(self, state_dict: dict[str, Tensor] | None) -> None:
        """Hold new weights until ``update_model_version`` names their version (``LocalWeightTransfer``)."""
        with self._lock:
            self._staged = state_dict

    def update_model_version(self, model_version: int) -> None:
        """The trainer's live version: the staged weights are applied under it at the next decode step."""
        with self._lock:
            if self._staged is not None:
                self._pending, self._staged = (model_version, self._staged), None

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the thread failed (its exception chained), is not running, or made no group in ``stale_after_s``."""
        if self._error is not None:
            raise RuntimeError("LocalRolloutWorker failed; see the chained exception") from self._error
        if not self.is_alive():
            raise RuntimeError("LocalRolloutWorker is not running (start() was not called, or it stopped)")
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(f"LocalRolloutWorker made no group in {age:.0f}s > {stale_after_s:.0f}s")

    def _poll_weights(self) -> tuple[int, dict[str, Tensor]] | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def _run(self) -> None:
        try:
            group_id = 0
            while not self._stopping.is_set():
                rows = [self.dataset[(group_id + j) % len(self.dataset)] for j in range(self.prompts_per_batch)]
                start = time.time()
                groups = self.groups(rows, group_id)
                if self._stopping.is_set():  # generation was cut short: not groups to train on
                    return
                for sample in (sample for group in groups for sample in group):
                    self._put(sample)
                self.metrics_queue.put({"rollout/batch_s": time.time() - start})
                self._heartbeat = time.time()
                group_id += len(rows)
        except BaseException as error:  # kept for check_health, which the trainer calls while it waits
            self._error = error

    def _put(self, sample: RolloutSample) -> None:
        while not self._stopping.is_set():
            try:
                self.rollout_buffer.put(dataclasses.replace(sample, enqueued_at=time.time()), timeout=0.1)
                return
            except queue.Full:
                self._heartbeat = time.time()  # waiting for the trainer is not a hang

    def groups(self, rows: list[Mapping[str, Any]], first_group_id: int) -> list[list[RolloutSample]]:
        """The ``num_generations`` scored samples of each prompt of ``rows`` (dataset rows), sampled in one batch;
        groups numbered from ``first_group_id``."""
        prompt_ids = [self.tokenizer(row["prompt"])["input_ids"] for row in rows]
        gens = self.engine.generate([ids for ids in prompt_ids for _ in range(self.num_generations)], self.sampling,
                                    weight_poll=self._poll_weights, generator=self.generator,
                                    stop=self._stopping.is_set)
        n = self.num_generations
        return [self.scored_group(row, ids, gens[j * n: (j + 1) * n], first_group_id + j)
                for j, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True))]

    def scored_group(self, row: Mapping[str, Any], prompt_ids: list[int], gens: list[Generation],
                     group_id: int) -> list[RolloutSample]:
        """One prompt's generations as TRL samples: rewards summed over the functions, GRPO advantages."""
        version = min((g.versions[0] for g in gens if g.versions), default=self.engine.version)
        completions = [self.tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in gens]
        columns = {key: [value] * len(gens) for key, value in row.items() if key != "prompt"}
        rewards_FN = np.array([[np.nan if r is None else float(r) for r in f(
            prompts=[row["prompt"]] * len(gens), completions=completions,
            completion_ids=[g.response_ids for g in gens], **columns)] for f in self.reward_funcs])
        unscored_N = np.isnan(rewards_FN).all(axis=0)
        rewards_N = np.where(unscored_N, np.nan, np.nansum(rewards_FN, axis=0))
        advantages_N = np.zeros(len(gens))
        if (~unscored_N).sum() > 0:
            scored = torch.as_tensor(rewards_N[~unscored_N])
            advantages_N[~unscored_N] = grpo_advantages(scored, torch.zeros_like(scored, dtype=torch.long)).numpy()
        names = [getattr(f, "__name__", type(f).__name__) for f in self.reward_funcs]
        return [RolloutSample(
            prompt=row["prompt"], completion=completions[i],
            input_ids=np.asarray(prompt_ids + g.response_ids, dtype=np.int64),
            completion_mask=np.asarray([0] * len(prompt_ids) + [1] * len(g.response_ids), dtype=np.int64),
            old_log_probs=np.asarray([0.0] * len(prompt_ids) + g.behavior_logprobs, dtype=np.float32),
            advantage=float(advantages_N[i]), model_version=version, group_id=group_id,
            metrics={"reward": float(rewards_N[i]), **{f"rewards/{n}": float(rewards_FN[k, i])
                                                         for k, n in enumerate(names)}},
        ) for i, g in enumerate(gens)]


class LocalWeightTransfer:
    """TRL's ``WeightTransferProtocol`` for a ``LocalRolloutWorker``: the trainer's weights are copied into the
    worker's process memory (``send_weights``) and applied by the worker at its next decode step once TRL names
    their version (``update_model_version``). Nothing needs setting up, pausing or releasing: generation never
    reads a half-copied state dict, since the worker swaps whole state dicts between decode steps."""

    def __init__(self, worker: LocalRolloutWorker) -> None:
        self.worker = worker

    def init_weight_transfer(self) -> None:
        """Nothing to set up: the worker shares the trainer's process."""

    def pause(self) -> None:
        """Nothing to pause: new weights wait in the worker until TRL names their version."""

    def send_weights(self, iterator: Iterator[tuple[str, Tensor]]) -> None:
        """Copy every ``(name, tensor)`` to the CPU and stage them in the worker."""
        self.worker.stage_weights({name: tensor.detach().to("cpu", copy=True) for name, tensor in iterator})

    def resume(self) -> None:
        """Nothing to resume (see ``pause``)."""

    def destroy(self) -> None:
        """Drop weights staged and not yet applied."""
        self.worker.stage_weights(None)
