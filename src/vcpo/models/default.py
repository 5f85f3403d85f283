"""The embedded default policy: a tiny random-initialised Llama with a character-level tokenizer.

Both are saved in Hugging Face format, so the rest of vcpo loads them exactly like any local model.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from vcpo.config import ArchitectureConfig
from vcpo.tasks.base import Task

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
BASE_CHARACTERS = string.printable  # digits, letters, punctuation and whitespace: the fixed base vocabulary
VOCAB_SAMPLE = 2000  # problems per split scanned for characters outside the base

# Llama rather than Qwen2: for model_type "qwen2" transformers 5's AutoTokenizer swaps in its own
# Qwen2Tokenizer pipeline, which would drop the spaces of a character tokenizer.
# Architecture of the default model (about 0.4M parameters): small enough that SFT plus a few minutes
# of RL run on two CPU cores, large enough to learn two-term sums of small numbers. sft.architecture sets another.
DEFAULT_ARCHITECTURE = ArchitectureConfig()
HIDDEN_SIZE = DEFAULT_ARCHITECTURE.hidden_size
NUM_LAYERS = DEFAULT_ARCHITECTURE.num_layers
NUM_HEADS = DEFAULT_ARCHITECTURE.num_heads
INTERMEDIATE_SIZE = DEFAULT_ARCHITECTURE.intermediate_size
MAX_POSITIONS = 512


def build_char_tokenizer(characters: str) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of ``characters`` plus ``<pad>``, ``<eos>``, ``<unk>``.

    Token ids: the special tokens first (0, 1, 2), then the characters in sorted order.
    """
    chars = sorted(set(characters) - set(SPECIAL_TOKENS))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own "word"; Fuse joins decoded tokens without the spaces WordLevel would insert.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def task_characters(task: Task, seed: int) -> str:
    """Every character in a sample of the task's prompts and answers (both splits)."""
    seen: set[str] = set()
    for split in ("train", "eval"):
        for problem in task.problems(split, VOCAB_SAMPLE, seed):
            seen.update(problem.prompt)
            seen.update(problem.answer)
    return "".join(sorted(seen))


def build_default_model(task: Task, seed: int, out_dir: str | Path,
                        architecture: ArchitectureConfig = DEFAULT_ARCHITECTURE) -> Path:
    """Save a random-initialised Llama of ``architecture`` (the tiny default unless given) and its character
    tokenizer to ``out_dir``; returns the path.

    The vocabulary is printable ASCII plus any other character found in the task's problems, so every
    prompt and answer tokenizes without ``<unk>``. Weights are in safetensors; both halves load offline
    with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    out = Path(out_dir)
    tokenizer = build_char_tokenizer(BASE_CHARACTERS + task_characters(task, seed))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=architecture.hidden_size,
        intermediate_size=architecture.intermediate_size,
        num_hidden_layers=architecture.num_layers,
        num_attention_heads=architecture.num_heads,
        num_key_value_heads=architecture.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
