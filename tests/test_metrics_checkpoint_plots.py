"""Metrics JSONL, atomic checkpoints (exact resume of weights, optimizer and RNG) and run plots."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from vcpo.metrics import MetricsError, MetricsLogger, read_metrics, truncate_metrics
from vcpo.plots import PlotError, plot_run
from vcpo.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

from conftest import vcpo

# ---------------------------------------------------------------- metrics


def test_jsonl_round_trip_and_non_finite_as_null(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log({"step": 1, "reward/mean": 0.5, "n": 3})
        logger.log({"step": 2, "loss/pg": float("nan"), "ess/ratio": float("inf"), "x": np.float32(0.25)})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert text.count("\n") == 2
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.5, "n": 3},
        {"step": 2, "loss/pg": None, "ess/ratio": None, "x": 0.25},
    ]


def test_log_rejects_missing_step_and_non_numeric(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(MetricsError, match="step"):
            logger.log({"reward/mean": 1.0})
        with pytest.raises(MetricsError, match="'bad'"):
            logger.log({"step": 1, "bad": [1, 2]})


def test_truncated_last_line_tolerated_and_repaired_on_reopen(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a')  # crash mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    with MetricsLogger(tmp_path) as logger:  # resuming cuts the torn tail before appending
        logger.log({"step": 3, "a": 3.0})
    assert read_metrics(path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}, {"step": 3, "a": 3.0}]


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(MetricsError, match=r"metrics\.jsonl:2"):
        read_metrics(path)
    with pytest.raises(MetricsError, match="not found"):
        read_metrics(tmp_path / "missing.jsonl")


def test_truncate_metrics_keeps_steps_up_to_resume_point(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log({"step": step, "reward/mean": step / 10})
    assert truncate_metrics(tmp_path / "metrics.jsonl", after_step=3) == 3
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left
    assert truncate_metrics(tmp_path / "absent.jsonl", after_step=3) == 0


# ---------------------------------------------------------------- checkpoints


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=40,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *"0123456789+-=* "])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def train_step(model, optimizer) -> None:
    """One AdamW step on a batch drawn from the global torch RNG (so RNG restore matters too)."""
    input_ids_BT = torch.randint(3, 40, (2, 6))
    loss = model(input_ids=input_ids_BT, labels=input_ids_BT).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def draws(generator: torch.Generator) -> list[float]:
    return [random.random(), float(np.random.rand()), torch.rand(1).item(), torch.rand(1, generator=generator).item()]


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_checkpoint_resume_continues_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = tiny_model(0), tiny_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer)  # so that the optimizer has moments to save
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    sampler = torch.Generator().manual_seed(4)
    saved_weights = weights(model)
    ckpt = save_checkpoint(tmp_path, 1, model, tokenizer, optimizer, {"data_index": 17}, {"sampler": sampler})
    assert ckpt == tmp_path / "checkpoints" / "step_000001"

    train_step(model, optimizer)  # the uninterrupted run continues
    expected_weights, expected_draws = weights(model), draws(sampler)

    resumed = tiny_model(99)  # a fresh process: other init, empty optimizer, other RNG states
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    other_sampler = torch.Generator().manual_seed(123)
    torch.manual_seed(555)
    state = load_checkpoint(latest_checkpoint(tmp_path), resumed, resumed_opt, generators={"sampler": other_sampler})
    assert state == {"data_index": 17, "step": 1}
    for k, v in weights(resumed).items():
        assert torch.equal(v, saved_weights[k]), k
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight  # tying survives the load
    train_step(resumed, resumed_opt)
    for k, v in weights(resumed).items():
        assert torch.equal(v, expected_weights[k]), k
    assert draws(other_sampler) == expected_draws

    # The directory is a plain Hugging Face checkpoint.
    hf_model = AutoModelForCausalLM.from_pretrained(ckpt)
    for k, v in hf_model.state_dict().items():
        assert torch.equal(v, saved_weights[k]), k
    assert AutoTokenizer.from_pretrained(ckpt)("12+3").input_ids == tokenizer("12+3").input_ids == [4, 5, 13, 6]


def test_keep_prunes_and_tmp_leftovers_are_ignored(tmp_path):
    model, tokenizer = tiny_model(0), tiny_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters())
    root = tmp_path / "checkpoints"
    (root / "step_000000.tmp-1").mkdir(parents=True)  # an interrupted save from an earlier process
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, {}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (root / "latest").read_text().strip() == "step_000003"
    save_checkpoint(tmp_path, 3, model, tokenizer, optimizer, {"again": True}, keep=2)  # re-saving a step replaces it
    assert json.loads((root / "step_000003" / "trainer_state.json").read_text()) == {"again": True, "step": 3}
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]

    (root / "step_000009.tmp-4242").mkdir()  # crash after the tmp dir was written, before the rename
    (root / "step_000009.tmp-4242" / "trainer_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == root / "step_000003"
    (root / "latest").write_text("step_000007\n")  # points to a dir that is gone
    assert latest_checkpoint(tmp_path) == root / "step_000003"
    assert latest_checkpoint(tmp_path / "no_run") is None


def test_keep_none_keeps_every_checkpoint_and_a_run_passes_keep_checkpoints_on(tmp_path, tiny):
    model, tokenizer = tiny_model(0), tiny_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, {}, keep=None)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_000001", "step_000002", "step_000003"]
    run_dir = tmp_path / "run"
    vcpo("train", *tiny, f"run_dir={run_dir}", "async.mode=sync", "trainer.max_steps=3", "trainer.eval_every=0",
         "trainer.checkpoint_every=1", "trainer.keep_checkpoints=null")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        "step_000001", "step_000002", "step_000003"]


def test_missing_or_corrupt_checkpoint_names_the_path(tmp_path):
    model, tokenizer = tiny_model(0), tiny_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="not found: .*nowhere"):
        load_checkpoint(tmp_path / "nowhere", model, optimizer)
    ckpt = save_checkpoint(tmp_path, 5, model, tokenizer, optimizer, {})
    with pytest.raises(CheckpointError, match="no state for generator.*sampler"):
        load_checkpoint(ckpt, model, optimizer, generators={"sampler": torch.Generator()})
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="step_000005/model.safetensors are corrupt"):
        load_checkpoint(ckpt, model, optimizer)
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete: no optimizer.pt"):
        load_checkpoint(ckpt, model, optimizer)


# ---------------------------------------------------------------- plots


def write_synthetic_metrics(run_dir) -> None:
    with MetricsLogger(run_dir) as logger:
        for step in range(1, 21):
            line = {
                "step": step,
                "reward/mean": step / 20,
                "ess/ratio": 1 - step / 40,
                "ess/ratio_clipped": 0.9,
                "grad_norm": 1.0 if step != 15 else 50.0,
                "lr": 1e-4,
                "staleness/mean": 1.5,
                "staleness/max": 2,
                "staleness/min": 0,
            }
            if step % 5 == 0:
                line["eval/accuracy"] = step / 25
            logger.log(line)


def test_plot_run_writes_every_panel(tmp_path):
    write_synthetic_metrics(tmp_path)
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [
        "reward.png",
        "eval_accuracy.png",
        "ess_ratio.png",
        "grad_norm.png",
        "staleness.png",
        "lr.png",
        "overview.png",
    ]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_plot_run_skips_missing_keys(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward/mean": 0.1}) + "\n" + json.dumps({"step": 2, "reward/mean": None}) + "\n"
    )
    assert [p.name for p in plot_run(tmp_path)] == ["reward.png", "overview.png"]


def test_plot_errors(tmp_path):
    with pytest.raises(PlotError, match="metrics.jsonl not found"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="is empty"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss/pg": 0.3}\n')
    with pytest.raises(PlotError, match="none of reward/mean"):
        plot_run(tmp_path)


def test_eval_series_starts_at_the_warm_start():
    from vcpo.plots import _series

    records = [{"step": 1, "eval/accuracy_initial": 0.3}, {"step": 2, "eval/accuracy": 0.4}]
    assert _series(records, "eval/accuracy") == ([0, 2], [0.3, 0.4])
    assert _series(records, "reward/mean") == ([], [])


def test_moving_average_and_binomial_band_by_hand():
    from vcpo.plots import binomial_band, ema, smoothing_span

    # span 3: a = 2 / 4 = 0.5; bias-corrected: 0/0.5 -> 0.0; (0.5*0 + 0.5*4) / (0.5*0.5 + 0.5) = 2 / 0.75
    assert ema([0.0, 4.0], 3) == pytest.approx([0.0, 8 / 3])
    assert ema([1.0, 100.0], 3, log=True) == pytest.approx([1.0, 100 ** (0.5 / 0.75)])  # geometric, for log axes
    assert ema([5.0] * 4, 7) == pytest.approx([5.0] * 4)
    assert [smoothing_span(n) for n in (10, 29, 30, 120, 300, 5000)] == [1, 1, 3, 10, 25, 25]
    # p = 0.5, n = 100: 1.96 * sqrt(0.25 / 100) = 0.098
    assert binomial_band(0.5, 100) == pytest.approx((0.402, 0.598))
    assert binomial_band(0.99, 4) == pytest.approx((0.99 - 1.96 * (0.0099 / 4) ** 0.5, 1.0))  # cut at 1


def test_panels_have_units_raw_faint_under_the_average_and_the_eval_band(tmp_path):
    from matplotlib.figure import Figure

    from vcpo.plots import PANELS, _draw, _series, eval_problems

    records = [{"step": s, "reward/mean": (s % 7) / 7, "eval/accuracy": 0.5 if s % 10 == 0 else None,
                "eval/problems": 100 if s % 10 == 0 else None} for s in range(1, 61)]
    assert eval_problems(records, tmp_path) == 100
    (tmp_path / "config.yaml").write_text("task: {eval_size: 40}\n")
    assert eval_problems(records[:5], tmp_path) == 40  # older runs: the saved config's task.eval_size
    by_name = {p.filename: p for p in PANELS}
    assert all(p.ylabel for p in PANELS)

    ax = Figure().add_subplot()
    reward = by_name["reward.png"]
    _draw(ax, reward, {line: _series(records, line.key) for line in reward.lines}, 100)
    raw, smooth = ax.get_lines()
    assert raw.get_alpha() == 0.25 and smooth.get_alpha() is None and len(smooth.get_xdata()) == 60
    assert ax.get_xlabel() == "optimizer step" and ax.get_ylabel() == "mean reward per completion"

    ax = Figure().add_subplot()
    acc = by_name["eval_accuracy.png"]
    _draw(ax, acc, {line: _series(records, line.key) for line in acc.lines}, 100)
    assert "95% binomial band (n = 100)" in ax.get_legend_handles_labels()[1]
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() == pytest.approx(0.402) and band.max() == pytest.approx(0.598)


def test_staleness_lines_that_coincide_stay_distinguishable():
    from vcpo.plots import PANELS

    staleness = next(p for p in PANELS if p.filename == "staleness.png")
    styles = [(line.width, line.dash) for line in staleness.lines]
    assert len(set(styles)) == len(styles)
    ess = next(p for p in PANELS if p.filename == "ess_ratio.png")
    assert len({(line.width, line.dash) for line in ess.lines}) == 2
