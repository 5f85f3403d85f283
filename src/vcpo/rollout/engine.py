"""The rollout engine: batched KV-cache sampling from a Hugging Face causal LM with per-token provenance.

Every generated token carries the log-prob of the distribution it was actually drawn from and the
policy version of the weights that produced it; weights may change between decode steps (partial
rollouts, as in PipelineRL), so one response can span versions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch import Tensor, nn

from vcpo.types import Generation, SamplingParams

WeightPoll = Callable[[], tuple[int, Mapping[str, Tensor]] | None]
"""Called before every forward pass of a generation: None, or (new version, new state dict) to apply now."""


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
    broken_B = torch.isnan(logits_BV).any(-1) | torch.isposinf(logits_BV).any(-1) | ~torch.isfinite(logits_BV).any(-1)
    if bool(broken_B.any()):
        logits_BV = logits_BV.masked_fill(broken_B[:, None], 0.0)  # a stand-in that samples; its result is discarded
    logq_BV = torch.log_softmax(logits_BV / sampling.temperature, dim=-1)
    if greedy:
        tokens_B = logq_BV.argmax(dim=-1)
        logprobs_B = logq_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    else:
        tokens_B, logprobs_B = _sample(logq_BV, sampling.top_p, generator)
    if bool(broken_B.any()):
        tokens_B = tokens_B.masked_fill(broken_B, 0)
        logprobs_B = logprobs_B.masked_fill(broken_B, math.nan)
    return tokens_B, logprobs_B


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
    input_ids_BP = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long)
    attention_mask_BP = torch.zeros((len(prompt_ids), P), dtype=torch.long)
    for b, prompt in enumerate(prompt_ids):
        input_ids_BP[b, P - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask_BP[b, P - len(prompt) :] = 1
    position_ids_BP = (attention_mask_BP.cumsum(dim=-1) - 1).clamp(min=0)
    return input_ids_BP.to(device), attention_mask_BP.to(device), position_ids_BP.to(device)


class HFRolloutEngine:
    """``RolloutEngine`` for any Hugging Face causal LM: left-padded batch, prefill, then one token per step.

    The model is put in eval mode and used in place: ``load_weights`` copies into its parameters.
    A ``generator`` must live on the model's device.
    """

    def __init__(self, model: nn.Module, eos_id: int, pad_id: int, version: int = 0) -> None:
        self.model = model.eval()
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.version = version

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy ``state_dict`` (e.g. the learner's, same architecture) into the model in place; set the version.

        Every parameter and persistent buffer must be covered, except aliases of a covered tensor
        (tied embeddings, which ``save_pretrained`` stores once). Values are cast to the model's dtype.
        """
        targets = self.model.state_dict(keep_vars=True)
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

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        *,
        weight_poll: WeightPoll | None = None,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> list[Generation]:
        """Sample a response for every prompt; see ``sample_next`` for the distribution and its log-prob.

        A row stops after EOS (which is recorded, ``finished=True``) or at ``max_new_tokens``. Before
        every forward pass ``weight_poll`` may hand over new weights: the same sequences continue with
        the KV cache computed so far (old-weight entries are kept) and later tokens record the new version.
        """
        _check_request(prompt_ids, sampling)
        gens = [Generation(response_ids=[], behavior_logprobs=[], versions=[], finished=False) for _ in prompt_ids]
        if not prompt_ids or sampling.max_new_tokens == 0:
            return gens
        device = next(self.model.parameters()).device
        input_ids_BL, attention_mask_BL, position_ids_BL = _left_pad(prompt_ids, self.pad_id, device)
        next_position_B = position_ids_BL[:, -1] + 1
        active_B = torch.ones(len(prompt_ids), dtype=torch.bool, device=device)
        past_key_values = None
        for _ in range(sampling.max_new_tokens):
            if weight_poll is not None and (update := weight_poll()) is not None:
                self.load_weights(update[1], version=update[0])
            out = self.model(
                input_ids=input_ids_BL,
                attention_mask=attention_mask_BL,
                position_ids=position_ids_BL,
                past_key_values=past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
            past_key_values = out.past_key_values
            tokens_B, logprobs_B = sample_next(out.logits[:, -1], sampling, generator, greedy)
            tokens, logprobs = tokens_B.tolist(), logprobs_B.tolist()
            for b in active_B.nonzero().flatten().tolist():
                gens[b].response_ids.append(tokens[b])
                gens[b].behavior_logprobs.append(logprobs[b])
                gens[b].versions.append(self.version)
                gens[b].finished = tokens[b] == self.eos_id and not math.isnan(logprobs[b])
            # A row sampled from broken logits (NaN log-prob) ends here, unfinished.
            active_B &= (tokens_B != self.eos_id) & ~torch.isnan(logprobs_B)
            if not active_B.any():
                break
            # Finished rows keep stepping with a masked pad token so the batch stays rectangular.
            input_ids_BL = torch.where(active_B, tokens_B, self.pad_id)[:, None]
            attention_mask_BL = torch.cat([attention_mask_BL, active_B.long()[:, None]], dim=-1)
            position_ids_BL = next_position_B[:, None]
            next_position_B = next_position_B + 1
        return gens
