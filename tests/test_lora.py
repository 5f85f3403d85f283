"""LoRA (model.lora.*): only the adapters train and travel, the checkpoint holds them in peft's layout, resume is exact,
the fast OPOB norms agree with the exact per-row ones on peft's LoRA layers."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from test_e2e_cli import assert_resumed_run_matches
from vcpo.config import load_config
from vcpo.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraError,
    adapter_base,
    apply_lora,
    load_adapter,
    peft_state_dict,
    save_adapter,
    sync_state_dict,
)
from vcpo.rollout.engine import HFRolloutEngine, WeightLoadError
from vcpo.variance import trajectory_grad_sq_norms

from conftest import LAGGED, metrics, vcpo

pytest.importorskip("peft")

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(dtype).eval()


def randomise_adapters(model: torch.nn.Module, std: float = 0.3) -> None:
    """B is zero at the start (the adapter adds nothing): give every adapter tensor values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, std)


def batch(B: int = 5, S: int = 12, vocab: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(1, vocab, (B, S))
    attention = torch.ones(B, S, dtype=torch.long)
    attention[1, -4:] = 0  # right padding on two rows
    attention[3, -2:] = 0
    response = attention.clone()
    response[:, :4] = 0  # the prompt
    return ids, response, attention


def test_only_the_adapters_train_and_sync_and_the_start_is_the_base():
    base = tiny_llama()
    ids, _, attention = batch()
    before = base(input_ids=ids, attention_mask=attention).logits
    model = apply_lora(base, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    assert model is base  # injected in place: class and config unchanged
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert sorted(sync_state_dict(model)) == sorted(trainable)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=attention).logits, before, rtol=0, atol=0)
    assert len(sync_state_dict(tiny_llama())) == len(tiny_llama().state_dict())  # no LoRA: everything


def test_an_unknown_target_module_names_the_key():
    with pytest.raises(LoraError, match="model.lora.target_modules"):
        apply_lora(tiny_llama(), rank=4, alpha=8.0, target_modules=["no_such_proj"])


def test_a_lora_engine_takes_exactly_the_adapters():
    learner = apply_lora(tiny_llama(), rank=4, alpha=8.0)
    randomise_adapters(learner)
    engine = HFRolloutEngine(apply_lora(tiny_llama(), rank=4, alpha=8.0), eos_id=0, pad_id=0)
    ids, _, attention = batch()
    engine.load_weights(sync_state_dict(learner), version=3)
    assert engine.version == 3
    torch.testing.assert_close(engine.model(input_ids=ids, attention_mask=attention).logits,
                               learner(input_ids=ids, attention_mask=attention).logits, rtol=0, atol=0)
    partial = dict(list(sync_state_dict(learner).items())[1:])
    with pytest.raises(WeightLoadError, match="no value for"):
        engine.load_weights(partial, version=4)
    with pytest.raises(WeightLoadError, match="not in the rollout model"):
        engine.load_weights(learner.state_dict(), version=4)  # base keys: a full model is not what it takes


def test_the_adapter_round_trips_in_peft_layout(tmp_path):
    model = apply_lora(tiny_llama(), rank=4, alpha=8.0)
    model.config._name_or_path = "/models/base"
    randomise_adapters(model)
    save_adapter(model, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {ADAPTER_WEIGHTS, ADAPTER_CONFIG}
    fresh = apply_lora(tiny_llama(), rank=4, alpha=8.0)
    load_adapter(fresh, tmp_path)
    for (k, a), (_, b) in zip(sync_state_dict(model).items(), sync_state_dict(fresh).items(), strict=True):
        assert torch.equal(a, b), k
    other = apply_lora(tiny_llama(), rank=2, alpha=8.0)
    with pytest.raises(LoraError, match="does not fit"):
        load_adapter(other, tmp_path)
    saved = load_file(tmp_path / ADAPTER_WEIGHTS)  # what vLLM is sent: the synced tensors under peft's names
    published = peft_state_dict(sync_state_dict(model))
    assert published.keys() == saved.keys() and all(torch.equal(published[k], saved[k]) for k in saved)


@pytest.mark.parametrize(("kind", "rank", "culprit"), [("sglang", 4, "rollout.server.kind=sglang"),
                                                       ("vllm", 513, "rank 512 at most")])
def test_servers_that_cannot_serve_the_adapters_are_refused(kind, rank, culprit):
    with pytest.raises(ValueError, match=culprit):
        load_config("configs/quickstart.yaml", [f"model.lora.rank={rank}", "rollout.engine=server",
                                                f"rollout.server.kind={kind}", "rollout.server.urls=[http://x:1]"])


@pytest.mark.parametrize("chunked_head", [False, True])
@pytest.mark.parametrize(("dtype", "targets", "rtol"), [
    (torch.float64, "all-linear", 1e-10),
    (torch.float64, ["q_proj", "v_proj", "down_proj"], 1e-10),
    (torch.float32, "all-linear", 1e-4),
])
def test_fast_grad_norms_equal_the_exact_per_row_ones_on_lora_layers(monkeypatch, dtype, targets, rtol, chunked_head):
    """G_b over the adapters only: sum over adapted layers of ||grad A_b||^2 + ||grad B_b||^2 (ghost_layers' linear
    rule on peft's lora_A / lora_B), against one backward per row; also with the frozen head run in vocabulary
    chunks (the path large batches take), which then gives the body its gradient and no norm of its own."""
    if chunked_head:
        from vcpo.variance import ghost_head, logprobs

        monkeypatch.setattr(logprobs, "LEAN_MIN_LOGITS", 0)
        monkeypatch.setattr(ghost_head, "VOCAB_CHUNK", 7)
    model = apply_lora(tiny_llama(dtype), rank=4, alpha=8.0, target_modules=targets)
    randomise_adapters(model)
    model.to(dtype)  # peft keeps adapters in float32; the float64 check needs them in float64 too
    ids, response, attention = batch()
    exact = trajectory_grad_sq_norms(model, ids, response, attention, method="exact")
    fast = trajectory_grad_sq_norms(model, ids, response, attention, method="fast")
    assert bool((exact > 0).all())
    torch.testing.assert_close(fast, exact, rtol=rtol, atol=0)


def test_a_lora_step_moves_the_adapters_only(tiny_overrides):
    from vcpo.train.learner import Learner
    from vcpo.types import Batch, SamplingParams, Trajectory

    config = load_config("configs/quickstart.yaml", [*tiny_overrides, *LORA, "advantage.estimator=grpo",
                                                     "objective.name=reinforce"])
    model = apply_lora(tiny_llama(), rank=4, alpha=8.0)
    base_before = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    learner = Learner(model, config)
    assert sum(p.numel() for p in learner.params) == sum(v.numel() for v in sync_state_dict(model).values())
    trajectories = [Trajectory(problem_uid="p", group_id=0, prompt_ids=[3, 4, 5], response_ids=[6 + i, 7, 8],
                               behavior_logprobs=[-3.0] * 3, versions=[0] * 3, reward=float(i % 2), finished=True,
                               sampling=SamplingParams()) for i in range(4)]
    learner.step(Batch.from_trajectories(trajectories, pad_id=0))
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base_before.items())
    assert any(float(v.abs().max()) > 0 for k, v in after.items() if ".lora_B." in k)  # B left zero


def test_a_lora_checkpoint_holds_the_adapter_and_exports_to_what_transformers_loads(tmp_path, tiny):
    """The checkpoint: the adapter in peft's layout, naming its base. ``vcpo export`` (merged, and base + adapter side
    by side): ``AutoModelForCausalLM.from_pretrained`` gives the learner's log-probs on a fresh sequence."""
    from transformers import AutoModelForCausalLM

    from vcpo.models.loading import load_policy
    from vcpo.variance import token_logprobs

    run = tmp_path / "run"
    vcpo("train", *tiny, *LORA, f"run_dir={run}", "async.mode=sync", "trainer.max_steps=2")
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / ADAPTER_WEIGHTS).is_file() and (ckpt / ADAPTER_CONFIG).is_file()
    assert not (ckpt / "model.safetensors").exists()  # the base is fixed: not copied into every checkpoint
    base = adapter_base(ckpt)
    assert "chain_sum-" in base and base.startswith("/")  # the warm-started base, wherever the run is read from
    assert all(m["mismatch/logprob_abs_max"] < 1e-4 for m in metrics(run))  # sync: every token is fresh

    learner, tokenizer = load_policy(base)
    apply_lora(learner, rank=4, alpha=8.0)
    load_adapter(learner, ckpt)
    ids = torch.tensor([tokenizer.encode("12+34=46 and 7+8=15")])
    with torch.no_grad():
        expected = token_logprobs(learner, ids, torch.ones_like(ids))
        assert float((expected - token_logprobs(load_policy(base)[0], ids, torch.ones_like(ids))).abs().max()) > 1e-4
    for merge in (True, False):
        out = tmp_path / f"export-{merge}"
        vcpo("export", str(ckpt), "--out", str(out), *(["--merge"] if merge else []))
        assert (out / ADAPTER_WEIGHTS).is_file() != merge
        exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        with torch.no_grad():
            got = token_logprobs(exported, ids, torch.ones_like(ids))
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    proc = vcpo("export", str(ckpt), "--out", str(out), check=False)
    assert proc.returncode == 2 and "--out" in proc.stderr and "not an empty directory" in proc.stderr


def test_lora_lagged_resume_equals_uninterrupted_run(tmp_path, tiny):
    full = tmp_path / "full"
    vcpo("train", *tiny, *LAGGED, *LORA, f"run_dir={full}")
    assert_resumed_run_matches(full, tmp_path / "part", [*tiny, *LAGGED, *LORA])


def test_adapter_dropout_acts_in_the_gradient_pass_only(tiny_overrides):
    from vcpo.train.learner import Learner
    from vcpo.types import Batch, SamplingParams, Trajectory

    config = load_config("configs/quickstart.yaml", [*tiny_overrides, *LORA, "model.lora.dropout=0.5"])
    model = apply_lora(tiny_llama(), rank=4, alpha=8.0, dropout=0.5)
    randomise_adapters(model)
    learner = Learner(model, config)
    assert len(learner.dropouts) == 2 * 7  # every adapted linear layer of both blocks
    trajectories = [Trajectory(problem_uid="p", group_id=i // 2, prompt_ids=[3, 4, 5], response_ids=[6 + i, 7, 8],
                               behavior_logprobs=[-3.0] * 3, versions=[0] * 3, reward=float(i % 2), finished=True,
                               sampling=SamplingParams()) for i in range(4)]
    b = Batch.from_trajectories(trajectories, pad_id=0)
    with torch.no_grad():  # sampling and evaluation: no dropout, the same numbers twice
        a1, a2 = (learner.logprobs(b, grad=False) for _ in range(2))
    assert torch.equal(a1, a2)
    g1, g2 = (learner.logprobs(b).detach() for _ in range(2))  # gradient passes: two dropout masks
    assert not torch.equal(g1, g2)
    assert all(not m.training for m in learner.dropouts)
    assert math.isfinite(learner.step(b)["grad_norm"])


def test_lora_without_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(LoraError, match=r"pip install 'vcpo\[lora\]'"):
        apply_lora(tiny_llama(), rank=4, alpha=8.0)
