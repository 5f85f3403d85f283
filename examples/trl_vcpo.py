"""vcpo inside TRL's GRPOTrainer: the few lines a TRL script changes (docs/integrations.md).

Runs on the CPU in seconds with a tiny randomly initialised model built here (no download):
    pip install 'vcpo[trl]' && python examples/trl_vcpo.py
Each generated batch is reused for two optimizer steps (steps_per_generation=2), so every second step is
off-policy: its ESS ratio falls below 1 and its learning rate is cut by the ESS rule.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig

from vcpo.integrations.trl import VCPOGRPOTrainer  # 1. instead of `from trl import GRPOTrainer`
from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer


def digit_share(completions: list[str], **_: object) -> list[float]:
    """A toy reward: the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / (1 + len(c)) for c in completions]


def tiny_model() -> tuple[LlamaForCausalLM, object]:
    """A 2-layer Llama (hidden 32) with a character tokenizer: stands in for your model."""
    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tokenizer


def main(steps: int = 6) -> list[dict]:
    model, tokenizer = tiny_model()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=str(Path(out)), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                          num_generations=4, steps_per_generation=2, max_completion_length=8, max_steps=steps,
                          learning_rate=5e-2, logging_steps=1, save_strategy="no", disable_tqdm=True)
        trainer = VCPOGRPOTrainer(
            model=model, reward_funcs=digit_share, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]}),
            objective="vcpo", objective_kwargs={"cap": 8.0},  # 2. any vcpo objective and its hyperparameters
            advantage_estimator="opob", opob_variant="grad_only", grad_norm_method="logit_proxy",  # 3. OPOB
            ess_lr_rule="sqrt",  # 4. the ESS-scaled learning rate (None turns it off)
        )
        trainer.train()
    logs = [line for line in trainer.state.log_history if "loss" in line]
    for line in logs:
        print(f"step {line['step']}: ESS ratio {line['ess/ratio']:.3f}, lr scale {line['lr_scale']:.3f}, "
              f"max |log W| {line['is/logw_abs_max']:.3f}, loss {line['loss']:.3f}")
    return logs


if __name__ == "__main__":
    main()
