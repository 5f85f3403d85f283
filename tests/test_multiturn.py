"""Multi-turn episodes: token-in/token-out, masks, per-token versions across turns, budgets, and the batch, staleness
and tool metrics built from them; scripted engine, tokenizer and environment, no model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vcpo.envs.multiturn import EnvStep, is_multiturn
from vcpo.loop.trainer import batch_metrics
from vcpo.orchestration.staleness import staleness_metrics
from vcpo.rollout.collect import collect_groups
from vcpo.rollout.episodes import run_episodes
from vcpo.types import Batch, Generation, Problem, SamplingParams, Trajectory

EOS = 1
# Ids 10 and 11 both decode to "a"; encoding "a" gives 10. A loop that decoded the sampled turn and re-encoded it
# would put 10 where the engine sampled 11.
DECODE = {10: "a", 11: "a", 20: "o", EOS: ""}


class AmbiguousTokenizer:
    eos_token_id = EOS
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(DECODE[i] for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [{"a": 10, "o": 20}[c] for c in text]}


class ScriptedEngine:
    """Each call returns the next scripted turn per row; the policy version goes up by one after every sampled token
    (an in-flight update between every decode step), and every context it saw is recorded."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns = turns
        self.version = 0
        self.contexts: list[list[list[int]]] = []

    def generate(self, prompt_ids, sampling, *, weight_poll=None, generator=None, greedy=False):
        self.contexts.append([list(p) for p in prompt_ids])
        turn = self.turns[len(self.contexts) - 1]
        gens = []
        for _ in prompt_ids:
            ids = turn[: sampling.max_new_tokens]
            versions = [self.version + n for n in range(len(ids))]
            gens.append(Generation(ids, [-0.5 - n for n in range(len(ids))], versions, ids[-1:] == [EOS]))
        self.version += len(turn)
        return gens


class ScriptedEnv:
    """Observation [20, 20] after every turn until ``done_at`` (then reward 1); records what it was shown."""

    mask_void_turns = True

    def __init__(self, max_turns=3, max_total_tokens=100, done_at=2) -> None:
        self.max_turns, self.max_total_tokens, self.done_at = max_turns, max_total_tokens, done_at
        self.seen: list[list[list[int]]] = []

    def step(self, tokenizer, problems, turn_ids, turn_index):
        self.seen.append([list(t) for t in turn_ids])
        if turn_index == self.done_at:
            return [EnvStep([], done=True, reward=1.0) for _ in problems]
        return [EnvStep([20, 20], done=False, tool_calls=1) for _ in problems]

    def demonstration(self, problem):
        return []


PROBLEM = Problem(uid="p", prompt="a", answer="1")


def test_sampled_ids_are_never_re_encoded_and_observations_are_masked():
    engine = ScriptedEngine([[11, EOS], [11, 11, EOS], [10, EOS]])
    env = ScriptedEnv()
    assert is_multiturn(env)
    (ep,) = run_episodes(engine, AmbiguousTokenizer(), env, [PROBLEM], [[10]], SamplingParams(max_new_tokens=8))
    # Turn 2 continues from prompt + turn 1 as sampled (11, not the 10 that re-encoding "a" would give) + observation.
    assert engine.contexts[1] == [[10, 11, EOS, 20, 20]]
    assert engine.contexts[2] == [[10, 11, EOS, 20, 20, 11, 11, EOS, 20, 20]]
    assert env.seen == [[[11, EOS]], [[11, 11, EOS]], [[10, EOS]]]
    assert ep.response_ids == [11, EOS, 20, 20, 11, 11, EOS, 20, 20, 10, EOS]
    assert ep.mask == [1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # Versions: turn 1 sampled at 0, 1; engine at 2 for turn 2 (2, 3, 4); engine at 5 for turn 3 (5, 6).
    # Observation tokens repeat the version of the model token before them.
    assert ep.versions == [0, 1, 1, 1, 2, 3, 4, 4, 4, 5, 6]
    assert ep.behavior_logprobs == [-0.5, -1.5, 0.0, 0.0, -0.5, -1.5, -2.5, 0.0, 0.0, -0.5, -1.5]
    assert (ep.reward, ep.finished, ep.turns, ep.tool_calls) == (1.0, True, 3, 2)


def test_max_turns_ends_the_episode_unanswered_without_a_dangling_observation():
    engine = ScriptedEngine([[11, EOS], [11, EOS]])
    (ep,) = run_episodes(engine, AmbiguousTokenizer(), ScriptedEnv(max_turns=2, done_at=99), [PROBLEM], [[10]],
                         SamplingParams(max_new_tokens=8))
    assert ep.response_ids == [11, EOS, 20, 20, 11, EOS]  # the second observation would have no turn after it
    assert (ep.reward, ep.finished, ep.turns) == (0.0, False, 2)


def test_total_token_budget_caps_the_turn_and_ends_the_episode():
    engine = ScriptedEngine([[11, 11, 11, EOS], [11, 11, 11, EOS]])
    (ep,) = run_episodes(engine, AmbiguousTokenizer(), ScriptedEnv(max_total_tokens=8, done_at=99), [PROBLEM],
                         [[10]], SamplingParams(max_new_tokens=8))
    # Turn 1: 4 tokens + 2 observation = 6; turn 2 gets 8 - 6 = 2 new tokens; then the budget is spent.
    assert ep.response_ids == [11, 11, 11, EOS, 20, 20, 11, 11]
    assert len(engine.contexts) == 2 and ep.reward == 0.0 and not ep.finished


def test_batch_masks_observations_and_untrainable_trajectories():
    sp = SamplingParams()
    common = dict(problem_uid="p", group_id=0, prompt_ids=[5, 6], behavior_logprobs=[-1.0, 0.0, -2.0],
                  versions=[3, 3, 4], reward=1.0, finished=True, sampling=sp)
    t1 = Trajectory(response_ids=[7, 8, 9], response_mask=[1, 0, 1], **common)
    t2 = Trajectory(response_ids=[7, 8, 9], response_mask=[1, 0, 1], trainable=False, **common)
    t3 = Trajectory(response_ids=[7, 8, 9], **common)  # single-turn: every response token counts
    batch = Batch.from_trajectories([t1, t2, t3], pad_id=0)
    assert batch.response_mask_BS.tolist() == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert batch.behavior_logprobs_BS[0].tolist() == [0.0, 0.0, -1.0, 0.0, -2.0]


def test_staleness_and_length_count_model_tokens_and_tool_metrics_add_up():
    sp = SamplingParams()
    # Model tokens at versions 2 and 4; the observation token carries version 0 here to prove it is ignored.
    t1 = Trajectory("p", 0, [5], [7, 8, 9], [-1.0, 0.0, -1.0], [2, 0, 4], 1.0, True, sp, response_mask=[1, 0, 1],
                    env_stats={"turns": 2.0, "tool_calls": 1.0, "tool_errors": 1.0, "void": 0.0})
    t2 = Trajectory("p", 0, [5], [7], [-1.0], [4], 0.0, True, sp, response_mask=[1], trainable=False,
                    env_stats={"turns": 1.0, "tool_calls": 0.0, "tool_errors": 0.0, "void": 1.0})
    # Lags at learner version 5: 3, 1, 1 -> min 1, mean 5/3, max 3.
    assert staleness_metrics([t1, t2], 5) == {"staleness/min": 1.0, "staleness/mean": 5 / 3, "staleness/max": 3.0}
    m = batch_metrics([t1, t2], 5)
    assert m["response/length_mean"] == 1.5  # (2 + 1) / 2 model tokens
    assert m["tools/calls_per_episode"] == 0.5 and m["tools/turns_mean"] == 1.5
    assert m["tools/errors"] == 1.0 and m["tools/void_frac"] == 0.5
    assert m["tools/masked_frac"] == pytest.approx(1 / 4)  # 1 observation token of 4 response tokens


def test_single_turn_batches_have_no_tool_metrics():
    t = Trajectory("p", 0, [5], [7], [-1.0], [0], 1.0, True, SamplingParams())
    assert not any(k.startswith("tools/") for k in batch_metrics([t], 0))


def test_collect_groups_routes_a_multiturn_task_into_scored_groups():
    class Task(ScriptedEnv):
        name = "scripted"

        def problems(self, split, n, seed):
            return [PROBLEM] * n

        def reward(self, problem, completion):
            raise AssertionError("a multi-turn task is scored by its environment")

    engine = ScriptedEngine([[11, EOS], [11, EOS]])
    (group,) = collect_groups(engine, AmbiguousTokenizer(), Task(done_at=1), [PROBLEM], [7], 2,
                              SamplingParams(max_new_tokens=4), torch.Generator())
    assert [t.group_id for t in group] == [7, 7] and [t.reward for t in group] == [1.0, 1.0]
    assert group[0].response_mask == [1, 1, 0, 0, 1, 1] and group[0].prompt_ids == [10]
    assert group[0].env_stats["turns"] == 2.0 and group[0].trainable


@pytest.mark.parametrize("method", ["fast", "exact"])
def test_learner_ignores_observation_tokens_log_probs_and_untrainable_rows(method):
    """A VCPO/OPOB learner step is the same whatever behavior log-probs and versions observation tokens and
    untrainable trajectories carry: ESS, OPOB norms and the objective read the mask only."""
    import copy

    import transformers

    from vcpo.config import load_config
    from vcpo.train.learner import Learner

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64)).eval()
    cfg = load_config(None, ["objective.name=vcpo", "advantage.estimator=opob",
                             f"advantage.grad_norm_method={method}"])

    def step(obs_logprob: float, obs_version: int, void_logprob: float) -> tuple[list[torch.Tensor], dict]:
        trajs = []
        for i in range(8):
            mask = [1, 1, 0, 0, 1, 1]
            blp = [-1.0 - 0.1 * i, -2.0, obs_logprob, obs_logprob, -0.5, -1.5 + 0.05 * i]
            versions = [3, 3, obs_version, obs_version, 4, 4]
            t = Trajectory("u", i // 4, [5, 6, 7], [8 + i, 9, 20, 21, 10, 1], blp, versions, float(i % 3 == 0),
                           True, SamplingParams(), response_mask=mask)
            if i == 5:  # a void-turn trajectory: out of the loss whatever it holds
                t.trainable, t.behavior_logprobs = False, [void_logprob] * 6
            trajs.append(t)
        learner = Learner(copy.deepcopy(model), cfg)
        learner.version = 4
        metrics = learner.backward(Batch.from_trajectories(trajs, pad_id=0))
        return [p.grad.clone() for p in learner.params], metrics

    grads_a, m_a = step(0.0, 3, -1.0)
    grads_b, m_b = step(-40.0, 0, -60.0)
    assert m_a["ess/ratio"] == m_b["ess/ratio"] < 1.0
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(turn_lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5), obs_len=st.integers(0, 4),
       max_turns=st.integers(1, 5), budget=st.integers(1, 30), done_at=st.integers(0, 5))
def test_episode_invariants(turn_lengths, obs_len, max_turns, budget, done_at):
    """Whatever the script: aligned per-token lists, the budget and turn limit hold, observations are never at the
    end of an episode, and the model's tokens are exactly the sampled ones in order."""
    turns = [[11] * (n - 1) + [EOS] for n in turn_lengths] + [[EOS]] * 5

    class Env(ScriptedEnv):
        def step(self, tokenizer, problems, turn_ids, turn_index):
            if turn_index == done_at:
                return [EnvStep([], done=True, reward=1.0) for _ in problems]
            return [EnvStep([20] * obs_len, done=False) for _ in problems]

    engine = ScriptedEngine(turns)
    (ep,) = run_episodes(engine, AmbiguousTokenizer(), Env(max_turns, budget), [PROBLEM], [[10]],
                         SamplingParams(max_new_tokens=4))
    n = len(ep.response_ids)
    assert len(ep.mask) == len(ep.versions) == len(ep.behavior_logprobs) == n
    assert n <= budget and 1 <= ep.turns <= max_turns and ep.turns == len(engine.contexts)
    assert n == 0 or ep.mask[-1] == 1
    assert all(b == 0.0 for b, m in zip(ep.behavior_logprobs, ep.mask, strict=True) if not m)
    assert ep.versions == sorted(ep.versions)  # versions never go back along an episode
    assert ep.finished == (done_at < ep.turns) and ep.reward == float(ep.finished)
