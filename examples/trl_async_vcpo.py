"""vcpo inside TRL's asynchronous GRPO trainer, on a CPU (docs/integrations.md, "TRL's async trainer").

Runs in seconds with a tiny randomly initialised model built and saved here (no download, no GPU, no vLLM):
    pip install 'vcpo[trl]' && python examples/trl_async_vcpo.py
vcpo's rollout worker generates in a thread beside TRL's training loop, up to ``max_staleness`` versions ahead: the
stale steps' ESS ratio falls below 1 and their learning rate is cut by the ESS rule.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl.experimental.async_grpo import AsyncGRPOConfig

from vcpo.integrations.trl import LocalRolloutWorker, VCPOAsyncGRPOTrainer  # 1. instead of AsyncGRPOTrainer
from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer


def digit_share(completions: list[str], **_: object) -> list[float]:
    """A toy reward: the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / (1 + len(c)) for c in completions]


def save_tiny_model(out: Path) -> tuple[str, object]:
    """A 2-layer Llama (hidden 32) with a character tokenizer, saved to ``out``: stands in for your model's path."""
    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out), tokenizer


def main(steps: int = 8) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        model_path, tokenizer = save_tiny_model(Path(out) / "model")
        prompts = Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]})
        worker = LocalRolloutWorker(model_path, tokenizer, prompts, digit_share, num_generations=4,
                                    max_completion_length=8)  # 2. generation on the CPU, beside training
        args = AsyncGRPOConfig(output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False,
                               report_to="none", per_device_train_batch_size=8, num_generations=4,
                               max_completion_length=8, max_steps=steps, learning_rate=5e-2, logging_steps=1,
                               save_strategy="no", disable_tqdm=True, token_budget=0, max_staleness=3)
        trainer = VCPOAsyncGRPOTrainer(
            model=model_path, reward_funcs=digit_share, args=args, train_dataset=prompts, processing_class=tokenizer,
            rollout_worker=worker,  # LocalWeightTransfer(worker) syncs the weights
            objective="vcpo", objective_kwargs={"cap": 8.0},  # 3. any vcpo objective and its hyperparameters
            advantage_estimator="opob", opob_variant="grad_only", grad_norm_method="logit_proxy",  # 4. OPOB
            ess_lr_rule="sqrt",  # 5. the ESS-scaled learning rate (None turns it off)
        )
        trainer.train()
    logs = [line for line in trainer.state.log_history if "loss" in line]
    for line in logs:
        print(f"step {line['step']}: staleness mean {line['sample/staleness_mean']:.2f} max "
              f"{line['sample/staleness_max']:.0f}, ESS ratio {line['ess/ratio']:.3f}, lr scale "
              f"{line['lr_scale']:.3f}, max |log W| {line['is/logw_abs_max']:.3f}")
    return logs


if __name__ == "__main__":
    main()
