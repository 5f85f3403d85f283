"""The rollout engine: batched KV-cache sampling from a Hugging Face causal LM with per-token provenance.

Every generated token carries the log-prob of the distribution it was actually drawn from and the
policy version of the weights that produced it; weights may change between decode steps (partial
rollouts, as in PipelineRL), so one response can span versions.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vcpo.models.lora import sync_state_dict
from vcpo.types import Generation, SamplingParams
from vcpo.variance.logprobs import split_head

WeightPoll = Callable[[], tuple[int, Mapping[str, Tensor]] | None]
"""Called before every forward pass of a generation: None, or (new version, new state dict) to apply now."""


def cache_kwarg(module: nn.Module, past: Any) -> dict[str, Any]:
    """The KV cache as a forward keyword: ``cache`` where the model's forward takes it (transformers 5.2x renamed
    it and deprecates ``past_key_values``, to be removed in 5.40), ``past_key_values`` in earlier releases."""
    return {_cache_kwarg_name(type(module)): past}


@functools.cache
def _cache_kwarg_name(module_type: type) -> str:
    return "cache" if "cache" in inspect.signature(module_type.forward).parameters else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The updated KV cache of a forward's output, under either of transformers' names (see ``cache_kwarg``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


class RolloutError(ValueError):
    """A user-fixable problem with a generation request (sampling settings, prompts)."""


class WeightLoadError(ValueError):
    """A state dict that does not fit the engine's model; the message names the offending key."""


class RolloutEngine(Protocol):
    """Anything that turns prompts into ``Generation``s and accepts new weights, tagged by version."""

    version: int

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        *,
        weight_poll: WeightPoll | None = None,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> list[Generation]: ...

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None: ...


def sample_next(
    logits_BV: Tensor, sampling: SamplingParams, generator: torch.Generator | None = None, greedy: bool = False
) -> tuple[Tensor, Tensor]:
    """Draw one token per row; return ``(tokens_B, logprobs_B)`` with the log-prob of the distribution sampled.

    ``q = softmax(logits / T)``; top-p keeps the smallest set of most likely tokens whose mass under q
    reaches ``top_p`` (never empty), and ``mu = q restricted to that set, renormalised``. The token is
    drawn from mu and ``log mu(token)`` is returned. ``greedy`` takes ``argmax q`` and returns ``log q``.
    A row whose logits hold a NaN or +inf, or no finite value (broken weights), has no distribution: it
    gets token 0 and log-prob NaN, which the engine ends the row on and the learner skips the step for.
    """
    logits_BV = logits_BV.float()
    if sampling.temperature != 1.0:  # x / 1.0 == x: skip the pass over [B, V]
        logits_BV = logits_BV / sampling.temperature
    logq_BV = torch.log_softmax(logits_BV, dim=-1)
    # A NaN or +inf logit, or no finite one, makes the whole row of log q NaN, and a sound row has no NaN at
    # all: one column tells. Broken rows sample a stand-in (discarded) without a host sync to ask first; in place,
    # since log_softmax's output is this call's own tensor (no second [B, V] allocation per decode step).
    broken_B = torch.isnan(logq_BV[:, 0])
    logq_BV.masked_fill_(broken_B[:, None], 0.0)
    if greedy:
        tokens_B = logq_BV.argmax(dim=-1)
        logprobs_B = logq_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    else:
        tokens_B, logprobs_B = _sample(logq_BV, sampling.top_p, generator)
    return tokens_B.masked_fill(broken_B, 0), logprobs_B.masked_fill(broken_B, math.nan)


def _sample(logq_BV: Tensor, top_p: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    logmu_BV = logq_BV
    # top_p = 1 keeps everything; skipping the filter avoids dropping tail tokens to cumsum rounding.
    if top_p < 1.0:
        sorted_logq_BV, order_BV = logq_BV.sort(dim=-1, descending=True)
        mass_before_BV = sorted_logq_BV.exp().cumsum(dim=-1) - sorted_logq_BV.exp()
        # A token is kept while the mass of the tokens ranked above it is still short of top_p;
        # the most likely token has zero mass before it, so the nucleus is never empty.
        drop_sorted_BV = mass_before_BV >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logmu_BV = torch.log_softmax(logq_BV.masked_fill(drop_BV, float("-inf")), dim=-1)
    tokens_B = torch.multinomial(logmu_BV.exp(), 1, generator=generator).squeeze(-1)
    return tokens_B, logmu_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


def _resolved(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device (a generator reports ``cuda:0``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_request(prompt_ids: list[list[int]], sampling: SamplingParams) -> None:
    if not sampling.temperature > 0:
        raise RolloutError(f"sampling.temperature must be > 0, got {sampling.temperature} (use greedy=True for argmax)")
    if not 0 < sampling.top_p <= 1:
        raise RolloutError(f"sampling.top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.max_new_tokens < 0:
        raise RolloutError(f"sampling.max_new_tokens must be >= 0, got {sampling.max_new_tokens}")
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            raise RolloutError(f"prompt_ids[{i}] is empty: every prompt needs at least one token")


def _left_pad(prompt_ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids_BP, attention_mask_BP, position_ids_BP)``, left-padded to the longest prompt.

    Positions count real tokens only (``cumsum(mask) - 1``), so a left-padded row sees exactly the
    positions it would have unpadded, which is what the learner's right-padded recompute uses.
    """
    P = max(len(p) for p in prompt_ids)
    # Built on the host (one transfer), whatever the default device.
    input_ids_BP = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long, device="cpu")
    attention_mask_BP = torch.zeros((len(prompt_ids), P), dtype=torch.long, device="cpu")
    for b, prompt in enumerate(prompt_ids):
        input_ids_BP[b, P - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device="cpu")
        attention_mask_BP[b, P - len(prompt) :] = 1
    position_ids_BP = (attention_mask_BP.cumsum(dim=-1) - 1).clamp(min=0)
    return input_ids_BP.to(device), attention_mask_BP.to(device), position_ids_BP.to(device)


class HFRolloutEngine:
    """``RolloutEngine`` for any Hugging Face causal LM: left-padded batch, prefill, then one token per step.

    The model is put in eval mode and used in place: ``load_weights`` copies into its parameters. Sampled
    tokens and their log-probs stay on the model's device until the generation ends (one host sync per step:
    whether any row is still running). ``lm_head_fp32`` computes the logits in float32 from a half-precision
    model's hidden states (as the learner then does). A ``generator`` on another device than the model's seeds
    one there, deterministically.
    """

    def __init__(
        self, model: nn.Module, eos_id: int, pad_id: int, version: int = 0, lm_head_fp32: bool = False
    ) -> None:
        self.model = model.eval()
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.version = version
        self.lm_head_fp32 = lm_head_fp32
        self._head32: tuple[tuple, Tensor, Tensor | None] | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy ``state_dict`` (e.g. the learner's, same architecture) into the model in place; set the version.

        Every parameter and persistent buffer must be covered, except aliases of a covered tensor
        (tied embeddings, which ``save_pretrained`` stores once); for a LoRA model exactly its adapters' tensors
        (``vcpo.models.lora.sync_state_dict``: the base is fixed). Values are cast to the model's dtype.
        """
        targets = sync_state_dict(self.model, keep_vars=True)
        unexpected = sorted(set(state_dict) - set(targets))
        if unexpected:
            raise WeightLoadError(f"state dict key {unexpected[0]!r} is not in the rollout model")
        # Check everything before copying anything, so a rejected state dict leaves the model untouched.
        source_of: dict[int, str] = {}  # id of each target tensor -> the key that fills it
        for key, value in state_dict.items():
            target = targets[key]
            if target.shape != value.shape:
                raise WeightLoadError(
                    f"state dict key {key!r} has shape {tuple(value.shape)}, the rollout model {tuple(target.shape)}"
                )
            first = source_of.setdefault(id(target), key)
            if first != key and not torch.equal(state_dict[first], value):
                # Untied source weights into a tied model would otherwise silently keep the last one.
                raise WeightLoadError(f"state dict keys {first!r} and {key!r} differ but share one tensor here")
        missing = [k for k, t in targets.items() if id(t) not in source_of]
        if missing:
            raise WeightLoadError(f"state dict has no value for {missing[0]!r}")
        for key, value in state_dict.items():
            targets[key].copy_(value)
        self.version = version

    def _fp32_split(self) -> tuple[nn.Module, Tensor, Tensor | None] | None:
        """``(body, float32 head weight, bias)`` when the logits are to be computed in float32, else None.

        The float32 copy is made once per version of the weights (in-place updates bump ``_version``)."""
        if not self.lm_head_fp32:
            return None
        split = split_head(self.model)
        if split is None:
            raise RolloutError(f"lm_head_fp32: {type(self.model).__name__}'s logits are not a Linear head")
        body, head = split
        if head.weight.dtype in (torch.float32, torch.float64):
            return None  # already full precision: the model's own head is the same computation
        key = (head.weight.data_ptr(), head.weight._version)
        if self._head32 is None or self._head32[0] != key:
            bias = None if head.bias is None else head.bias.float()
            self._head32 = (key, head.weight.float(), bias)
        return body, self._head32[1], self._head32[2]

    def _next_logits(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, past) -> tuple[Tensor, Any]:
        """[B, V] logits of the next token of every row, and the updated KV cache."""
        split = self._fp32_split()
        if split is None:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, logits_to_keep=1, **cache_kwarg(self.model, past))
            return out.logits[:, -1], returned_cache(out)
        body, weight, bias = split
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                   **cache_kwarg(body, past))
        return F.linear(out.last_hidden_state[:, -1].float(), weight, bias), returned_cache(out)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        *,
        weight_poll: WeightPoll | None = None,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        stop: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        """Sample a response for every prompt; see ``sample_next`` for the distribution and its log-prob.

        A row stops after EOS (which is recorded, ``finished=True``) or at ``max_new_tokens``. Before
        every forward pass ``weight_poll`` may hand over new weights: the same sequences continue with
        the KV cache computed so far (old-weight entries are kept) and later tokens record the new version.
        ``stop`` (``vcpo serve``'s pause) is asked before every decode step: True ends every row there, each
        keeping the tokens it has (unfinished rows then hold fewer than ``max_new_tokens``).
        """
        _check_request(prompt_ids, sampling)
        gens = [Generation(response_ids=[], behavior_logprobs=[], versions=[], finished=False) for _ in prompt_ids]
        if not prompt_ids or sampling.max_new_tokens == 0:
            return gens
        device, B, N = self.device, len(prompt_ids), sampling.max_new_tokens
        if generator is not None and _resolved(generator.device) != _resolved(device):
            # drawn on the generator's own device (torch.randint takes a generator of the tensor's device only)
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            generator = torch.Generator(device).manual_seed(seed)
        input_ids_BL, prompt_mask_BP, position_ids_BL = _left_pad(prompt_ids, self.pad_id, device)
        P = prompt_mask_BP.shape[1]
        # Preallocated: the attention mask grows by a column per step as a view, tokens stay on the device.
        attention_mask_BM = torch.zeros((B, P + N), dtype=torch.long, device=device)
        attention_mask_BM[:, :P] = prompt_mask_BP
        tokens_BN = torch.full((B, N), self.pad_id, dtype=torch.long, device=device)
        logprobs_BN = torch.zeros((B, N), dtype=torch.float32, device=device)
        lengths_B = torch.zeros(B, dtype=torch.long, device=device)
        active_B = torch.ones(B, dtype=torch.bool, device=device)
        next_position_B = position_ids_BL[:, -1] + 1
        versions: list[int] = []  # the weights' version at each step (all rows step together)
        past_key_values = None
        for n in range(N):
            if stop is not None and stop():
                break
            if weight_poll is not None and (update := weight_poll()) is not None:
                self.load_weights(update[1], version=update[0])
            versions.append(self.version)
            logits_BV, past_key_values = self._next_logits(
                input_ids_BL, attention_mask_BM[:, : P + n], position_ids_BL, past_key_values
            )
            tokens_B, logprobs_B = sample_next(logits_BV, sampling, generator, greedy)
            tokens_BN[:, n] = tokens_B
            logprobs_BN[:, n] = logprobs_B
            lengths_B += active_B
            active_B &= (tokens_B != self.eos_id) & ~torch.isnan(logprobs_B)  # a broken row ends, unfinished
            if n + 1 == N or not bool(active_B.any()):
                break
            # Finished rows keep stepping with a masked pad token so the batch stays rectangular.
            attention_mask_BM[:, P + n] = active_B
            input_ids_BL = torch.where(active_B, tokens_B, self.pad_id)[:, None]
            position_ids_BL = next_position_B[:, None]
            next_position_B = next_position_B + 1
        tokens, logprobs, lengths = tokens_BN.tolist(), logprobs_BN.tolist(), lengths_B.tolist()
        for gen, row_tokens, row_logprobs, length in zip(gens, tokens, logprobs, lengths, strict=True):
            gen.response_ids = row_tokens[:length]
            gen.behavior_logprobs = row_logprobs[:length]
            gen.versions = versions[:length]
            last = length - 1
            gen.finished = length > 0 and row_tokens[last] == self.eos_id and not math.isnan(row_logprobs[last])
        return gens
