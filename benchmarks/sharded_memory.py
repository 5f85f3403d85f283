"""Memory per learner rank and weight-gather time under ``trainer.sharding: fsdp`` (issue 39), on the CPU with gloo,
and the same memory computed for Qwen2.5-0.5B, 7B and 32B.

Measured: for each model (a Llama saved locally with random weights) and each world size N, N local ranks build the
sharded model as a run does (``build_sharded_model``: meta device, rank 0 reads the weights on the CPU and broadcasts
them), take one VCPO step with fast OPOB norms on a fixed batch, and report per rank the bytes of its parameter
shards, gradient shards (after the backward) and AdamW state (after the step), counted from the local tensors, its
peak resident set before the publication, and the time of one publication: every rank gathers the weights a layer at
a time (``gathered_layers``) and rank 0 copies each layer into a mirror. N = 1 is one unsharded ``Learner``
(``trainer.sharding: none``) on the same batch, for reference. Then the driver's side of a publication from its
mirror, per engine kind (``publication``).

Computed: float32 master weights, float32 gradients and AdamW's two float32 moments are 16 bytes a parameter, over N
ranks; plus what is gathered whole in bfloat16 during a pass: the root's unit (embeddings, final norm, LM head), whole
from the first forward to the end of the backward, and one decoder layer. Activations are not counted (they depend
on the tokens per micro-batch), nor FSDP's prefetch of the next layer.

    python benchmarks/sharded_memory.py                           # small and medium, N = 1, 2, 4
    python benchmarks/sharded_memory.py --models large --world 1,2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MODELS = {  # hidden, layers, intermediate, heads, vocab (untied embeddings, as 7B and 32B have)
    "small": (256, 4, 768, 4, 8192),
    "medium": (512, 8, 1536, 8, 16384),
    "large": (1024, 12, 2816, 16, 32000),
}
QWEN = {  # Qwen2.5: hidden, layers, intermediate, heads, kv heads, vocab, tied
    "Qwen2.5-0.5B": (896, 24, 4864, 14, 2, 151936, True),
    "Qwen2.5-7B": (3584, 28, 18944, 28, 4, 152064, False),
    "Qwen2.5-32B": (5120, 64, 27648, 40, 8, 152064, False),
}
ROWS, GROUP, PROMPT, RESPONSE = 16, 2, 32, 32


def save_model(shape: tuple[int, int, int, int, int], out: Path) -> Path:
    """A random Llama of ``shape`` (hidden, layers, intermediate, heads, vocabulary; untied embeddings) and the
    default character tokenizer, saved as a Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer

    hidden, layers, inter, heads, vocab = shape
    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_batch(vocab: int):
    from vcpo.types import Batch

    g = torch.Generator().manual_seed(0)
    S = PROMPT + RESPONSE
    response = torch.zeros(ROWS, S, dtype=torch.long)
    response[:, PROMPT:] = 1
    return Batch(input_ids_BS=torch.randint(3, vocab, (ROWS, S), generator=g), attention_mask_BS=torch.ones(ROWS, S,
                 dtype=torch.long), response_mask_BS=response,
                 behavior_logprobs_BS=torch.where(response.bool(), -torch.rand(ROWS, S, generator=g) - 8.0, 0.0),
                 versions_BS=torch.zeros(ROWS, S, dtype=torch.long),
                 rewards_B=(torch.rand(ROWS, generator=g) > 0.5).float(),
                 group_ids_B=torch.arange(ROWS) // GROUP)


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def peak_rss_mib() -> float:
    """This process's resident high-water mark (``VmHWM``: its own, unlike ``ru_maxrss``, which a spawned process
    inherits from its parent's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


def run_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from vcpo.config import load_config
    from vcpo.train.data_parallel import init_process_group
    from vcpo.train.learner import Learner
    from vcpo.train.sharding import ShardedLearner, build_sharded_model, gathered_layers

    torch.set_num_threads(1)
    baseline = peak_rss_mib()
    overrides = ["objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast",
                 f"rollout.prompts_per_step={ROWS // GROUP}", f"rollout.group_size={GROUP}"]
    if world == 1:
        from vcpo.models.loading import load_policy

        learner = Learner(load_policy(model_dir, "float32", "cpu")[0], load_config(None, overrides))
    else:
        init_process_group(rank, world, "127.0.0.1", port, 600)
        config = load_config(None, [*overrides, f"trainer.num_learners={world}", "trainer.sharding=fsdp"])
        learner = ShardedLearner(build_sharded_model(model_dir, config, torch.device("cpu")), config)
    batch = make_batch(learner.model.config.vocab_size)
    t0 = time.perf_counter()
    learner.backward(batch)
    grads = local_bytes(p.grad for p in learner.optimizer.updated if p.grad is not None)
    learner.step(batch)
    step_s = time.perf_counter() - t0
    params = local_bytes(learner.optimizer.updated)
    state = local_bytes(v for s in learner.optimizer.adamw.state.values() for v in s.values() if v.dim() > 0)
    row = {"rank": rank, "world": world, "params_MiB": params / 2**20, "grads_MiB": grads / 2**20,
           "adam_MiB": state / 2**20, "state_MiB": (params + grads + state) / 2**20, "baseline_rss_MiB": baseline,
           "peak_rss_MiB": peak_rss_mib(), "step_s": step_s}
    if world > 1:
        mirror = {name: torch.empty(p.shape) for name, p in learner.model.named_parameters()} if rank == 0 else {}
        t0 = time.perf_counter()
        for layer in gathered_layers(learner.model):
            for key, value in layer.items():
                if rank == 0:
                    mirror[key].copy_(value)
        row["gather_s"] = time.perf_counter() - t0
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(row, f)


def measure(name: str, world: int, model_dir: Path, tmp: Path) -> list[dict]:
    from vcpo.rollout.launch import free_port

    ctx = mp.get_context("spawn")
    out = str(tmp / f"{name}-{world}")
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, str(model_dir), out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=1800)
        if p.exitcode != 0:
            raise RuntimeError(f"{name} N={world}: a rank exited with {p.exitcode}")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def publication(name: str, model_dir: Path, runs: Path) -> dict:
    """The driver's side of a publication, from its mirror: into the shared copy the rollout worker processes read
    (``AsyncSource.publish``), and a version written for inference servers (``write_weights_dir``) on the run's disk
    and in /dev/shm. The in-process engine shares the mirror's tensors: nothing to publish."""
    from vcpo.models.loading import load_policy
    from vcpo.models.lora import sync_state_dict
    from vcpo.rollout.weights import write_weights_dir

    state = sync_state_dict(load_policy(model_dir, "float32", "cpu")[0])
    shared = {k: v.clone().share_memory_() for k, v in state.items()}
    row: dict = {"model": name, "MiB": sum(v.numel() * v.element_size() for v in state.values()) / 2**20}
    t0 = time.perf_counter()
    with torch.no_grad():
        for key, value in state.items():
            shared[key].copy_(value)
    row["workers_s"] = time.perf_counter() - t0
    for where, root in (("disk", runs), ("shm", Path("/dev/shm"))):
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            times = []
            for version in range(1, 4):
                t0 = time.perf_counter()
                write_weights_dir(tmp, state, version)
                times.append(time.perf_counter() - t0)
            row[f"server_write_{where}_s"] = sorted(times)[1]  # the median of 3
    return row


def computed() -> list[dict]:
    """Parameters counted on the meta device; 16 bytes each over N ranks, plus two gathered layers in bfloat16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    rows = []
    for name, (hidden, layers, inter, heads, kv, vocab, tied) in QWEN.items():
        config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             tie_word_embeddings=tied)
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
        total = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        root = total - layers * layer  # embeddings, final norm and LM head: the root's unit
        for world in (1, 8, 16, 32):
            rows.append({"model": name, "params_B": total / 1e9, "world": world,
                         "state_GiB": 16 * total / world / 2**30,
                         "gathered_GiB": 2 * (layer + root) / 2**30 if world > 1 else 0.0})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,medium")
    parser.add_argument("--world", default="1,2,4")
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    parser.add_argument("--disk", default=".", help="a directory on the disk runs write to (the server versions)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = save_model(MODELS[name], Path(tmp) / name)
            for world in (int(w) for w in args.world.split(",")):
                for row in measure(name, world, model_dir, Path(tmp)):
                    rows.append({"model": name} | row)
                    print(json.dumps(rows[-1]), flush=True)
            rows.append(publication(name, model_dir, Path(args.disk)))
            print(json.dumps(rows[-1]), flush=True)
    for row in computed():
        print(json.dumps(row))
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
