"""The trainer's domain vocabulary: problems, sampling settings, trajectories and batches.

Every trajectory carries its provenance (per-token behavior log-probs and policy versions, the
sampling settings, its prompt group); nothing is inferred later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

DROPPED_STATUS = "dropped"
"""The reward status of the one-row marker that stands for a group an agent task dropped (vcpo.agents.collect):
never trained on; the rollout sources leave it out of the batch and count it as ``agent/dropped_groups``."""


@dataclass(frozen=True)
class Problem:
    """One task instance: the prompt text shown to the model and what its scorer needs."""

    uid: str
    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] | None = None  # chat format: rendered by the tokenizer's chat template


@dataclass(frozen=True)
class SamplingParams:
    """How the rollout engine samples: the behavior log-probs are of this exact distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16


@dataclass
class Generation:
    """What the rollout engine returns for one prompt: response tokens with their provenance."""

    response_ids: list[int]
    behavior_logprobs: list[float]  # log mu(token | prefix) of the distribution actually sampled
    versions: list[int]  # policy version that produced each response token
    finished: bool  # ended with EOS (False: truncated at max_new_tokens)


@dataclass
class Trajectory:
    """A scored response to a prompt, with everything the learner needs about where it came from."""

    problem_uid: str
    group_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    reward: float
    finished: bool
    sampling: SamplingParams
    response_text: str = ""
    reward_status: str = "ok"  # ok, error, crash, timeout (vcpo.rewards.pool), or DROPPED_STATUS (a dropped group)
    # Multi-turn episodes (vcpo.envs.multiturn): 1 on tokens the model sampled, 0 on environment observations
    # (never trained on); None means every response token is the model's. ``trainable`` False takes the whole
    # trajectory out of the loss (SimpleTIR's void turns); ``env_stats`` holds per-episode counts (``tools/...``).
    response_mask: list[int] | None = None
    trainable: bool = True
    env_stats: dict[str, float] = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else 0

    def model_token_mask(self) -> list[int]:
        """1 on each response token the model sampled, 0 on observation tokens."""
        return list(self.response_mask) if self.response_mask is not None else [1] * len(self.response_ids)

    def model_versions(self) -> list[int]:
        """The policy versions of the model's own tokens (observation tokens left out)."""
        return [v for v, m in zip(self.versions, self.model_token_mask(), strict=True) if m]


def is_dropped_group(group: list[Trajectory]) -> bool:
    """Whether ``group`` is the marker of a group an agent task dropped (``DROPPED_STATUS``)."""
    return any(t.reward_status == DROPPED_STATUS for t in group)


@dataclass
class Batch:
    """Trajectories padded into [B, S] tensors, prompt then response, right-padded.

    Position t of ``behavior_logprobs_BS`` / ``versions_BS`` refers to token ``input_ids_BS[b, t]``;
    ``response_mask_BS`` is 1 on the response tokens the model sampled and is trained on (so position 0, the
    prompt, environment observations and untrainable trajectories are never counted).
    """

    input_ids_BS: Tensor
    attention_mask_BS: Tensor
    response_mask_BS: Tensor
    behavior_logprobs_BS: Tensor
    versions_BS: Tensor
    rewards_B: Tensor
    group_ids_B: Tensor

    @property
    def size(self) -> int:
        return int(self.input_ids_BS.shape[0])

    def rows(self, index: Tensor) -> Batch:
        """The batch of rows ``index`` (a 1-D index tensor), in that order."""
        return Batch(**{name: value.index_select(0, index) for name, value in self.__dict__.items()})

    def to(self, device: torch.device | str) -> Batch:
        """The batch with every tensor on ``device`` (tensors already there are not copied)."""
        return Batch(**{name: value.to(device) for name, value in self.__dict__.items()})

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], pad_id: int) -> Batch:
        if not trajectories:
            raise ValueError("cannot build a Batch from zero trajectories")
        S = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
        B = len(trajectories)
        input_ids = torch.full((B, S), pad_id, dtype=torch.long)
        attention = torch.zeros((B, S), dtype=torch.long)
        response = torch.zeros((B, S), dtype=torch.float32)
        blp = torch.zeros((B, S), dtype=torch.float32)
        versions = torch.zeros((B, S), dtype=torch.long)
        for b, t in enumerate(trajectories):
            p, r = len(t.prompt_ids), len(t.response_ids)
            input_ids[b, : p + r] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
            attention[b, : p + r] = 1
            if r:
                mask = t.model_token_mask() if t.trainable else [0] * r
                response[b, p : p + r] = torch.tensor(mask, dtype=torch.float32)
                blp[b, p : p + r] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
                versions[b, p : p + r] = torch.tensor(t.versions, dtype=torch.long)
        return cls(
            input_ids_BS=input_ids,
            attention_mask_BS=attention,
            response_mask_BS=response,
            behavior_logprobs_BS=blp,
            versions_BS=versions,
            rewards_B=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            group_ids_B=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        )
