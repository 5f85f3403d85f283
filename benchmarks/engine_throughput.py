"""Rollout engine throughput against Hugging Face's ``model.generate`` on the same prompts and sampling settings.

Both sample every row for exactly the setup's number of new tokens (the engine's EOS id is one it never samples;
``generate`` gets ``min_new_tokens`` equal to ``max_new_tokens``), at the same temperature and top-p, top-k off,
from the same left-padded prompts, on random-initialised Llama models built locally. The two run alternately,
``--repeats`` rounds after a warm-up; each prints generated tokens per second (median over rounds) and the last
line per setup is ``engine/generate tokens/s ratio: X.XX`` (the median of the per-round ratios).

    python benchmarks/engine_throughput.py                      # the default model and a 20M-parameter Llama, CPU
    python benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --setups default,large,qwen05b
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from step_overhead import Setup, build_model

from vcpo.models import default as default_model
from vcpo.rollout import HFRolloutEngine
from vcpo.runtime import configure_cpu
from vcpo.types import SamplingParams

SETUPS = {  # B = prompts x group rows, prompts of prompt_len // 2 to prompt_len tokens, response_len new tokens
    # The embedded default model (0.44M parameters) and the quickstart's 16 prompts x 8 samples.
    "default": Setup("default", default_model.HIDDEN_SIZE, default_model.NUM_LAYERS, default_model.NUM_HEADS,
                     default_model.INTERMEDIATE_SIZE, 103, 16, 8, 12, 32),
    # A 20M-parameter Llama (6 layers, d=384, 8k vocabulary), 64 rows.
    "large": Setup("large", 384, 6, 6, 1536, 8192, 8, 8, 32, 64),
    # Qwen2-0.5B's shape (random weights): 24 layers, d=896, 14 heads, 2 KV heads, vocabulary 151,936.
    "qwen05b": Setup("qwen05b", 896, 24, 14, 4864, 151936, 8, 8, 64, 128, kv_heads=2),
}


def prompts(s: Setup) -> list[list[int]]:
    """B prompts of ``prompt_len // 2`` to ``prompt_len`` tokens (ids >= 3: never pad or EOS)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(max(1, s.prompt_len // 2), s.prompt_len + 1, (s.prompts * s.group,), generator=g).tolist()
    return [torch.randint(3, s.vocab, (n,), generator=g).tolist() for n in lengths]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(model, batch: list[list[int]], sampling: SamplingParams, device: str, lm_head_fp32: bool) -> int:
    engine = HFRolloutEngine(model, eos_id=-1, pad_id=0, lm_head_fp32=lm_head_fp32)  # EOS never sampled
    gens = engine.generate(batch, sampling, generator=torch.Generator(device).manual_seed(0))
    sync(device)
    return sum(len(g.response_ids) for g in gens)


@torch.no_grad()
def run_generate(model, batch: list[list[int]], sampling: SamplingParams, device: str) -> int:
    P = max(map(len, batch))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in batch], device=device)
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=0, max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.max_new_tokens,
        pad_token_id=0, eos_token_id=1,
    )
    sync(device)
    return (out.shape[1] - P) * out.shape[0]


def measure(s: Setup, device: str, dtype: torch.dtype, top_p: float, repeats: int, lm_head_fp32: bool) -> None:
    model = build_model(s, device, dtype)
    batch = prompts(s)
    rows = s.prompts * s.group
    sampling = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=s.response_len)
    rates: dict[str, list[float]] = {"engine": [], "generate": []}
    for i in range(repeats + 1):  # round 0 warms up
        for name in rates:
            t0 = time.perf_counter()
            n = (run_engine(model, batch, sampling, device, lm_head_fp32) if name == "engine"
                 else run_generate(model, batch, sampling, device))
            dt = time.perf_counter() - t0
            assert n == rows * s.response_len, (name, n)
            if i:
                rates[name].append(n / dt)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    ratio = statistics.median(e / g for e, g in zip(rates["engine"], rates["generate"], strict=True))
    print(f"\nsetup {s.name}: {params:.2f}M params, {rows} rows, prompts <= {s.prompt_len}, "
          f"{s.response_len} new tokens, top_p {top_p}")
    for name, r in rates.items():
        print(f"{name:<10}{statistics.median(r):>12.0f} tokens/s (median of {repeats})")
    print(f"engine/generate tokens/s ratio: {ratio:.2f}")


def profile(s: Setup, device: str, dtype: torch.dtype, top_p: float, lm_head_fp32: bool) -> None:
    """Where one engine call and one ``generate`` call spend their time: torch.profiler's top operators."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model = build_model(s, device, dtype)
    batch = prompts(s)
    sampling = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=s.response_len)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    for name, run in (("engine", lambda: run_engine(model, batch, sampling, device, lm_head_fp32)),
                      ("generate", lambda: run_generate(model, batch, sampling, device))):
        run()  # warm-up
        with torch_profile(activities=activities) as prof:
            run()
        print(f"\nprofile of one {name} call ({s.name}):")
        print(prof.key_averages().table(sort_by=sort, row_limit=15))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="default,large", help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    ap.add_argument("--lm-head-fp32", action="store_true", help="the engine computes its logits in float32")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of one call of each instead")
    args = ap.parse_args()
    configure_cpu(args.threads)
    print(f"device={args.device} dtype={args.dtype} threads={args.threads} torch={torch.__version__} "
          f"transformers={transformers.__version__}")
    for name in args.setups.split(","):
        if args.profile:
            profile(SETUPS[name], args.device, getattr(torch, args.dtype), args.top_p, args.lm_head_fp32)
        else:
            measure(SETUPS[name], args.device, getattr(torch, args.dtype), args.top_p, args.repeats,
                    args.lm_head_fp32)


if __name__ == "__main__":
    main()
