"""Learner-step cost of OPOB: GRPO against VCPO with fast per-row norms and with the logit proxy, each OPOB
variant (plugin, grad_only, leave_one_out), and with exact per-row norms when asked (``--arms``).

Runs the learner steps on the same batch, interleaved round-robin so that machine drift hits every arm alike, and
reports the median step time, its ratio to GRPO's, the median of the per-round ratios ("paired x": robust to drift
slower than one round) and the peak memory of each (CUDA: the allocator's peak above the level before the step;
CPU: the resident-set rise of a step, in forked processes); the last lines are ``ARM/grpo step-time ratio: X.XX``
(the ratio of the medians) for the fast and proxy arms. ``--json PATH`` writes every figure.

    python benchmarks/step_overhead.py            # default model + a larger random configuration
    python benchmarks/step_overhead.py --quick    # fewer repeats, under 2 minutes on 2 CPU cores
    python benchmarks/step_overhead.py --setups default --equal-reward-groups 0.5   # training-like rewards
    python benchmarks/step_overhead.py --device cuda --setups large,xl   # on a GPU
    python benchmarks/step_overhead.py --device cuda --dtype bfloat16 --setups xl,qwen05b   # bfloat16 weights
    python benchmarks/step_overhead.py --device cuda --dtype bfloat16 --setups xl --profile vcpo_fast   # where it goes
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import multiprocessing
import statistics
import threading
import time
from dataclasses import dataclass
from unittest.mock import patch

import torch
import transformers

from vcpo.config import load_config
from vcpo.models import default as default_model
from vcpo.runtime import configure_cpu
from vcpo.train.learner import Learner
from vcpo.types import Batch, SamplingParams, Trajectory
from vcpo.variance import ghost_layers, token_logprobs


@dataclass(frozen=True)
class Setup:
    """A model configuration and a batch shape: B = prompts x group, prompt and response lengths."""

    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    prompts: int
    group: int
    prompt_len: int
    response_len: int
    kv_heads: int | None = None  # None: as many as the attention heads


SETUPS = {
    # The embedded default model and the quickstart batch (16 prompts x 8, "12 + 34 = " -> "46<eos>").
    "default": Setup("default", default_model.HIDDEN_SIZE, default_model.NUM_LAYERS, default_model.NUM_HEADS,
                     default_model.INTERMEDIATE_SIZE, 103, 16, 8, 8, 6),
    # More layers, wider, longer sequences (random initialisation).
    "large": Setup("large", 256, 6, 8, 1024, 512, 8, 8, 32, 96),
    "xl": Setup("xl", 1024, 12, 16, 4096, 32000, 8, 8, 128, 384),
    # Qwen2-0.5B's shape (random weights, built locally): 16 rows of up to 512 tokens.
    "qwen05b": Setup("qwen05b", 896, 24, 14, 4864, 151936, 2, 8, 128, 384, kv_heads=2),
    # For benchmarks/learner_memory.py: on the CPU a 32k vocabulary (32 rows of up to 256 tokens), where the
    # log-softmax dominates, and 12 deeper layers (16 rows of up to 256 tokens), where activations do; on a GPU
    # the 0.5B target (64 rows of up to 1,024 tokens).
    "medium": Setup("medium", 256, 4, 4, 1024, 32000, 4, 8, 64, 192),
    "deep": Setup("deep", 512, 12, 8, 2048, 8192, 2, 8, 64, 192),
    "qwen05b_1k": Setup("qwen05b_1k", 896, 24, 14, 4864, 151936, 8, 8, 256, 768, kv_heads=2),
}

_VCPO = ["objective.name=vcpo", "advantage.estimator=opob"]
ARMS = {
    "grpo": ["objective.name=grpo", "advantage.estimator=grpo", "trainer.ess_lr.enabled=false"],
    "vcpo_exact": [*_VCPO, "advantage.grad_norm_method=exact"],
    **{f"vcpo_{method}{'' if variant == 'plugin' else '_' + variant}": [
        *_VCPO, f"advantage.grad_norm_method={'fast' if method == 'fast' else 'logit_proxy'}",
        f"advantage.opob_variant={variant}"]
       for method in ("fast", "proxy") for variant in ("plugin", "grad_only", "leave_one_out")},
}
"""grpo; vcpo with exact norms; vcpo_fast / vcpo_proxy (the logit proxy), each with the paper's plug-in OPOB and
its _grad_only and _leave_one_out variants."""
DEFAULT_ARMS = ["grpo", "vcpo_fast", "vcpo_fast_grad_only", "vcpo_fast_leave_one_out", "vcpo_proxy",
                "vcpo_proxy_grad_only", "vcpo_proxy_leave_one_out"]


def build_model(s: Setup, device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The setup's random Llama (tied embeddings), initialised on ``device`` itself (a 0.5B model's random
    initialisation takes seconds on a GPU, minutes on a CPU core)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads or s.heads, intermediate_size=s.intermediate, tie_word_embeddings=True,
        max_position_embeddings=max(512, s.prompt_len + s.response_len),
    )
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).to(dtype=dtype).eval()


def build_batch(s: Setup, model: torch.nn.Module, device: str, equal_groups: float = 0.0) -> Batch:
    """A batch with varied response lengths, 0/1 rewards and stale behavior log-probs: the model's own
    log-probs plus N(0, 0.3) per token, so sequence weights spread around 1 as they do after a few
    policy versions (log-probs unrelated to the model would put every weight at the clamp floor).

    Rewards are fair coin flips, so nearly every group has differing rewards and every row needs its
    OPOB norm (the worst case); ``equal_groups`` is the fraction of groups given equal rewards instead
    (all 0 or all 1, alternately), as in training batches, where about half the groups are."""
    g = torch.Generator().manual_seed(1)
    n_equal = round(equal_groups * s.prompts)
    trajectories = []
    for i in range(s.prompts * s.group):
        r_len = int(torch.randint(max(1, s.response_len // 2), s.response_len + 1, (1,), generator=g))
        prompt = torch.randint(3, s.vocab, (s.prompt_len,), generator=g).tolist()
        response = torch.randint(3, s.vocab, (r_len,), generator=g).tolist()
        blp = (-3 * torch.rand(r_len, generator=g)).tolist()
        coin = float(torch.rand(1, generator=g) > 0.5)
        reward = float((i // s.group) % 2) if i // s.group < n_equal else coin
        trajectories.append(Trajectory("u", i // s.group, prompt, response, blp, [0] * r_len, reward, True,
                                       SamplingParams()))
    b = Batch.from_trajectories(trajectories, pad_id=0)
    b = Batch(**{k: v.to(device) for k, v in b.__dict__.items()})
    with torch.no_grad():  # the response tokens only (the lean path on large batches: no [B, S, V] logits)
        lp_BS = token_logprobs(model, b.input_ids_BS, b.attention_mask_BS, positions=b.response_mask_BS)
    noise_BS = 0.3 * torch.randn(lp_BS.shape, generator=g).to(device)
    b.behavior_logprobs_BS = torch.where(b.response_mask_BS.bool(), lp_BS + noise_BS, 0.0)
    return b


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator stats, or the process RSS sampled at 1 kHz."""

    def __init__(self, device: str) -> None:
        self.device = device

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = self._rss()
            self.running = True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.running = False
            self.thread.join()

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


UPCAST_ARM = "vcpo_fast_upcast"
"""--compare-upcast: the fast arm with half-precision factors upcast to float32 for every product (the code before
the bfloat16 factors were kept), in the same round-robin."""


def upcast_factors() -> contextlib.AbstractContextManager:
    return patch.object(ghost_layers, "_matmul_dtype", ghost_layers._compute_dtype)


def measure(s: Setup, device: str, repeats: int, warmup: int, equal_groups: float,
            dtype: torch.dtype = torch.float32, compare_upcast: bool = False,
            arm_names: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Median and min step time per arm, round-robin on one batch; on CUDA also the allocator's peak."""
    model = build_model(s, device, dtype)
    batch = build_batch(s, model, device, equal_groups)
    arms = {arm: ARMS[arm] for arm in arm_names or DEFAULT_ARMS}
    arms = {**arms, UPCAST_ARM: ARMS["vcpo_fast"]} if compare_upcast else arms
    learners = {arm: Learner(copy.deepcopy(model), load_config(None, overrides)) for arm, overrides in arms.items()}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    peaks: dict[str, float] = dict.fromkeys(arms, 0.0)
    for i in range(warmup + repeats):
        for arm, learner in learners.items():  # round-robin: drift hits every arm alike
            mem = PeakMemory(device) if device == "cuda" else contextlib.nullcontext()
            with mem, upcast_factors() if arm == UPCAST_ARM else contextlib.nullcontext():
                t0 = time.perf_counter()
                learner.step(batch)
                if device == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            if i >= warmup:
                times[arm].append(dt)
                if device == "cuda":
                    peaks[arm] = max(peaks[arm], mem.mib)
    # Each round runs the arms back to back, so a per-round ratio cancels drift slower than a round.
    return {arm: {"median_s": statistics.median(t), "min_s": min(t), "peak_mib": peaks[arm],
                  "paired_x": statistics.median(a / g for a, g in zip(t, times["grpo"], strict=True))}
            for arm, t in times.items()}


def _cpu_peak_rise(s: Setup, arm: str, threads: int, equal_groups: float, dtype: torch.dtype) -> float:
    """MiB: the RSS rise of one learner step (after two warm-up steps), run in its own process."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    model = build_model(s, "cpu", dtype)
    batch = build_batch(s, model, "cpu", equal_groups)
    learner = Learner(model, load_config(None, ARMS[arm]))
    for _ in range(2):
        learner.step(batch)
    with PeakMemory("cpu") as mem:
        learner.step(batch)
    return mem.mib


def cpu_peak_memory(s: Setup, threads: int, equal_groups: float, dtype: torch.dtype,
                    arms: list[str]) -> dict[str, float]:
    """Each arm's step working set on the CPU, measured apart from the timings: in a forked process that keeps
    glibc's default allocator, which returns large freed blocks, so the RSS rise during a step is what the step
    allocates (the timing process keeps freed memory for reuse, so its RSS would not move)."""
    ctx = multiprocessing.get_context("fork")
    result = {}
    for arm in arms:
        with ctx.Pool(1) as pool:
            result[arm] = pool.apply(_cpu_peak_rise, (s, arm, threads, equal_groups, dtype))
    return result


def profile_step(s: Setup, arm: str, device: str, dtype: torch.dtype, equal_groups: float) -> None:
    """torch.profiler's top operators (by GPU time on CUDA) of one learner step of ``arm`` after two warm-ups."""
    from torch.profiler import ProfilerActivity, profile

    model = build_model(s, device, dtype)
    batch = build_batch(s, model, device, equal_groups)
    learner = Learner(model, load_config(None, ARMS[arm]))
    for _ in range(2):
        learner.step(batch)
    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        learner.step(batch)
        if cuda:
            torch.cuda.synchronize()
    print(f"\nprofile of one {arm} step ({s.name}):")
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, default setup only (< 2 min on 2 cores)")
    ap.add_argument("--setups", default=None, help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights' dtype (bfloat16: float32 master weights in the optimizer)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    ap.add_argument("--compare-upcast", action="store_true",
                    help=f"add the arm {UPCAST_ARM}: fast norms with half-precision factors upcast to float32")
    ap.add_argument("--equal-reward-groups", type=float, default=0.0, metavar="FRACTION",
                    help="fraction of groups with equal rewards, whose rows need no OPOB norm (default 0: every "
                         "row needs one; the staleness study's training batches had about 0.5)")
    ap.add_argument("--profile", default=None, metavar="ARM", choices=list(ARMS),
                    help="print torch.profiler's table of one step of this arm (per setup) instead of timing")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma-separated, grpo first, from {', '.join(ARMS)}")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = ap.parse_args()
    arm_names = args.arms.split(",")
    if arm_names[0] != "grpo" or any(arm not in ARMS for arm in arm_names):
        ap.error(f"--arms: grpo first, then any of {', '.join(ARMS)}; got {args.arms}")
    if not 0.0 <= args.equal_reward_groups <= 1.0:
        ap.error(f"--equal-reward-groups must be in [0, 1], got {args.equal_reward_groups}")
    eq = args.equal_reward_groups
    dtype = getattr(torch, args.dtype)
    names = (args.setups or ("default" if args.quick else "default,large")).split(",")
    repeats = args.repeats or (7 if args.quick else 15)
    if args.profile:
        configure_cpu(args.threads)
        for name in names:
            profile_step(SETUPS[name], args.profile, args.device, dtype, eq)
        return
    # Memory first, in forked processes that keep the default allocator (see cpu_peak_memory).
    memory = ({name: cpu_peak_memory(SETUPS[name], args.threads, eq, dtype, arm_names) for name in names}
              if args.device == "cpu" else {})
    configure_cpu(args.threads)  # threads, flushed denormals, allocator: as the trainer does
    print(f"device={args.device} dtype={args.dtype} threads={args.threads} torch={torch.__version__} "
          f"repeats={repeats} equal-reward groups={eq:g}")
    ratios: dict[str, float] = {}
    figures: dict[str, dict] = {}
    for name in names:
        s = SETUPS[name]
        params = sum(p.numel() for p in build_model(s, "meta").parameters())
        res = measure(s, args.device, repeats, warmup=2, equal_groups=eq, dtype=dtype,
                      compare_upcast=args.compare_upcast, arm_names=arm_names)
        for arm, mib in memory.get(name, {}).items():
            res[arm]["peak_mib"] = mib
        print(f"\nsetup {name}: {params / 1e6:.2f}M params, B={s.prompts * s.group}, "
              f"prompt {s.prompt_len}, response <= {s.response_len}")
        print(f"{'arm':<26}{'median step (s)':>17}{'min (s)':>10}{'peak mem (MiB)':>16}{'x grpo':>9}"
              f"{'paired x':>10}{'mem x grpo':>12}")
        for arm, r in res.items():
            r["x"] = r["median_s"] / res["grpo"]["median_s"]
            r["mem_x"] = r["peak_mib"] / res["grpo"]["peak_mib"] if res["grpo"]["peak_mib"] > 0 else float("nan")
            print(f"{arm:<26}{r['median_s']:>17.4f}{r['min_s']:>10.4f}{r['peak_mib']:>16.1f}{r['x']:>9.2f}"
                  f"{r['paired_x']:>10.2f}{r['mem_x']:>12.2f}")
        figures[name] = {"params": params, "rows": s.prompts * s.group, **res}
        if name == names[0]:
            ratios = {arm: r["x"] for arm, r in res.items() if arm != "grpo"}
    if args.json:
        meta = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__, "repeats": repeats,
                "equal_reward_groups": eq}
        if args.device.startswith("cuda"):
            meta["gpu"] = torch.cuda.get_device_name()
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "setups": figures}, f, indent=2)
    print()
    for arm, x in ratios.items():
        print(f"{arm}/grpo step-time ratio: {x:.2f}")


if __name__ == "__main__":
    main()
