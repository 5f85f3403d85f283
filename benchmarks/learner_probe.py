"""What one learner step costs in the units a GPU is judged by, counted on the CPU: matrix-product FLOPs by operand
dtype, the operators that launch a kernel (a GPU step of a small model is bound by its launches as much as by its
FLOPs), every tensor of 200 MB or more that the step creates (op, shape, dtype), apart the parameter-shaped ones
(gradients, optimizer state and updates, which GRPO has as well) from the activations (flagged when a dimension is
the vocabulary and it holds more than one chunk of logits), and the resident-set rise. Side by side for GRPO, VCPO with
fast norms (each OPOB variant) and VCPO with the logit proxy, on one batch, so that a developer without a GPU can see
(and move) the float32 products and the vocabulary-sized tensors that make a GPU step slow.

Default shape: Qwen2.5-0.5B's widths (hidden 896, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied
embeddings) with 2 layers, bfloat16 weights, 2 rows of 512 tokens (prompt 128, response 384).
Attention runs in its eager form, so that its products are counted too.

    python benchmarks/learner_probe.py                       # the default shape, every arm
    python benchmarks/learner_probe.py --quick               # a 4k vocabulary and 128 tokens: seconds
    python benchmarks/learner_probe.py --arms grpo,vcpo_fast --layers 4
"""

from __future__ import annotations

import argparse
import multiprocessing
from collections import Counter
from dataclasses import dataclass, field

import torch
import transformers
from step_overhead import ARMS, PeakMemory, Setup, build_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from vcpo.config import load_config
from vcpo.train.learner import Learner
from vcpo.variance import logprobs

BIG_BYTES = 200 * 2**20
"""Tensors of at least this many bytes are listed."""


@dataclass
class StepCount:
    """What the dispatch mode saw during one step; ``big`` the large tensors that are not parameter-shaped."""

    flops: Counter = field(default_factory=Counter)
    big: list[tuple[str, tuple[int, ...], str, int]] = field(default_factory=list)
    parameter_shaped: int = 0
    launches: int = 0
    """Operators that run a kernel (views and other metadata operators aside): on a GPU, one launch each."""


class CountingMode(TorchDispatchMode):
    """Counts matrix-product FLOPs by the dtype of their first operand and records every large output."""

    def __init__(self, count: StepCount, parameter_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.count, self.parameter_shapes = count, parameter_shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        self.count.launches += _launches_a_kernel(func)
        # in-place products (baddbmm_, addmm_) count as their out-of-place forms
        counter = flop_registry.get(packet) or flop_registry.get(getattr(torch.ops.aten, packet.__name__.rstrip("_"),
                                                                         None))
        if counter is not None:
            dtype = next(a.dtype for a in args[1:] if isinstance(a, torch.Tensor))  # a product's first factor
            self.count.flops[str(dtype).removeprefix("torch.")] += counter(*args, **kwargs, out_val=out)
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, tuple | list) else (out,):
            # a view of an input (a transposed weight, say) holds no memory of its own
            if (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
                    and t.numel() * t.element_size() >= BIG_BYTES):
                if tuple(t.shape) in self.parameter_shapes:
                    self.count.parameter_shaped += 1
                    continue
                self.count.big.append((str(packet), tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                       t.numel() * t.element_size()))
        return out


def _launches_a_kernel(func) -> bool:
    """Whether an operator runs a kernel: it returns a tensor that is not a view of an input (in-place ones do), or
    reads a value to the host."""
    returns = func._schema.returns
    if func._overloadpacket is torch.ops.aten._local_scalar_dense:
        return True
    if not any(str(r.type).startswith("Tensor") for r in returns):
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def build_model(s: Setup, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads or s.heads, intermediate_size=s.intermediate, tie_word_embeddings=True,
        max_position_embeddings=max(512, s.prompt_len + s.response_len), attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype=dtype).eval()


PROBE_ARMS = {
    "grpo": ARMS["grpo"],
    "vcpo_fast": ARMS["vcpo_fast"],
    "vcpo_fast_grad_only": [*ARMS["vcpo_fast"], "advantage.opob_variant=grad_only"],
    "vcpo_fast_leave_one_out": [*ARMS["vcpo_fast"], "advantage.opob_variant=leave_one_out"],
    "vcpo_proxy_grad_only": [*ARMS["vcpo_fast"], "advantage.grad_norm_method=logit_proxy",
                             "advantage.opob_variant=grad_only"],
}


def probe(s: Setup, arm: str, dtype: torch.dtype) -> tuple[StepCount, float]:
    """The counted step (after a warm-up step) and, measured apart in this process, the RSS rise of another."""
    model = build_model(s, dtype)
    batch = build_batch(s, model, "cpu", full_length=True)
    batch.rewards_B = (torch.arange(len(batch.rewards_B)) % 2).to(batch.rewards_B)  # every group mixed: all norms
    learner = Learner(model, load_config(None, PROBE_ARMS[arm]))
    learner.step(batch)
    with PeakMemory("cpu") as mem:
        learner.step(batch)
    count = StepCount()
    with CountingMode(count, {tuple(p.shape) for p in model.parameters()}):
        learner.step(batch)
    launches = StepCount()  # the learner's passes alone: this CPU's AdamW is not a GPU's foreach one
    with CountingMode(launches, set()):
        learner.backward(batch)
    count.launches = launches.launches
    return count, mem.mib


def _probe_in_child(s: Setup, arm: str, dtype: torch.dtype, threads: int) -> tuple[StepCount, float]:
    """In a forked process with glibc's default allocator (not vcpo.runtime.configure_cpu's, which keeps freed
    memory): the RSS rise of a step is then what the step allocates."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    return probe(s, arm, dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 4k vocabulary, 2 layers, 128 tokens a row")
    ap.add_argument("--arms", default=",".join(PROBE_ARMS), help=f"comma-separated, from {', '.join(PROBE_ARMS)}")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2, help="rows, in groups of 2 (16: step_overhead's qwen05b)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.quick:
        s = Setup("quick", 256, args.layers, 4, 1024, 4096, 1, 2, 32, 96, kv_heads=2)
    else:
        s = Setup("qwen05b_probe", 896, args.layers, 14, 4864, 151936, max(1, args.rows // 2), 2, 128, 384, kv_heads=2)
    dtype = getattr(torch, args.dtype)
    arms = args.arms.split(",")
    chunk_bytes = logprobs.CHUNK_LOGITS * 4  # one chunk of float32 logits, as the lean head holds
    print(f"setup {s.name}: hidden {s.hidden}, {s.layers} layers, vocabulary {s.vocab}, {s.prompts * s.group} rows "
          f"of {s.prompt_len + s.response_len} tokens, {args.dtype} weights; torch {torch.__version__}")
    results = {}
    ctx = multiprocessing.get_context("fork")  # each arm in its own process: a clean allocator and RSS
    for arm in arms:
        with ctx.Pool(1) as pool:
            results[arm] = pool.apply(_probe_in_child, (s, arm, dtype, args.threads))
    base = sum(results[arms[0]][0].flops.values())
    print(f"\n| arm | matmul GFLOP | of which float32 | x {arms[0]} | parameter-shaped tensors >= 200 MB | "
          f"other tensors >= 200 MB | largest other | vocabulary-sized beyond a chunk | RSS rise (MiB) | "
          f"x {arms[0]} | kernel launches (backward) | x {arms[0]} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base_launches = results[arms[0]][0].launches
    base_rise = results[arms[0]][1]
    for arm, (count, rise) in results.items():
        total = sum(count.flops.values())
        fp32 = count.flops.get("float32", 0)
        largest = max(count.big, key=lambda b: b[3], default=None)
        vocab_big = [b for b in count.big if s.vocab in b[1] and b[3] > chunk_bytes]
        big = (f"{largest[0]} {list(largest[1])} {largest[2]} ({largest[3] / 2**20:.0f} MiB)"
               if largest else "-")
        print(f"| {arm} | {total / 1e9:.1f} | {fp32 / 1e9:.1f} | {total / base:.2f} | {count.parameter_shaped} | "
              f"{len(count.big)} | {big} | {len(vocab_big)} | {rise:.0f} | {rise / base_rise:.2f} | {count.launches} | "
              f"{count.launches / base_launches:.2f} |")
    for arm, (count, _) in results.items():
        for op, shape, dt, nbytes in sorted(count.big, key=lambda b: -b[3])[:6]:
            print(f"  {arm}: {op} {list(shape)} {dt} {nbytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
