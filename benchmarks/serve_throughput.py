"""Rollout throughput through `vcpo serve` or vLLM (HTTP, the server engine) against the in-process HF engine, and
the time of one weight update through the servers (safetensors directory + pause, update, resume, and for vLLM the
weight check); with vLLM also the log-prob gap to the Hugging Face model per sampling setting.

Both sample the same batches (random-initialised Llama models built locally, one torch thread per process) at
temperature 1 for up to ``max_new_tokens`` tokens; tokens/s counts the response tokens actually generated (a
random model says EOS now and then). In-process and HTTP rounds alternate after a warm-up; the last lines per
setup give the median tokens/s of each and the median of the per-round ratios, then the update times.

    python benchmarks/serve_throughput.py                         # default model and a 20M Llama, 1 and 2 servers
    python benchmarks/serve_throughput.py --setups default --repeats 5
    python benchmarks/serve_throughput.py --kind vllm --python .venv-vllm/bin/python --servers 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vcpo.config import LaunchConfig
from vcpo.models.default import (
    BASE_CHARACTERS,
    HIDDEN_SIZE,
    INTERMEDIATE_SIZE,
    NUM_HEADS,
    NUM_LAYERS,
    build_char_tokenizer,
)
from vcpo.models.loading import load_policy
from vcpo.rollout import HFRolloutEngine
from vcpo.rollout.launch import LaunchedServers
from vcpo.rollout.server import ServerRolloutEngine, ServerWeightPublisher, WeightCheck
from vcpo.rollout.server_pool import ServerPool
from vcpo.rollout.weights import write_weights_dir
from vcpo.runtime import configure_cpu
from vcpo.types import SamplingParams

SETUPS = {  # hidden, layers, heads, mlp, rows, prompt_len, max_new_tokens
    "default": (HIDDEN_SIZE, NUM_LAYERS, NUM_HEADS, INTERMEDIATE_SIZE, 128, 24, 32),  # the quickstart's 16 x 8
    "large": (384, 6, 6, 1536, 64, 32, 64),  # 14.2M parameters with the 103-token character vocabulary
}


def save_model(out: Path, hidden: int, layers: int, heads: int, mlp: int) -> Path:
    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


VLLM_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", "1G"]


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = sum(len(g.response_ids) for g in fn())
    return time.perf_counter() - t0, tokens


def processed_gap(model, prompts, gens, sampling: SamplingParams, greedy: bool) -> float:
    """max |server log-prob - log mu(token)|, mu = softmax(logits / T) restricted to the top-p set (greedy: T = 1)."""
    gap = 0.0
    for prompt, g in zip(prompts, gens, strict=True):
        if not g.response_ids:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + g.response_ids])).logits[0, len(prompt) - 1 : -1].float()
        if not greedy:
            logits = logits / sampling.temperature
            if sampling.top_p < 1:
                probs, order = torch.softmax(logits, -1).sort(-1, descending=True)
                keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, probs.cumsum(-1) - probs
                                                                          < sampling.top_p)
                logits = logits.masked_fill(~keep, float("-inf"))
        logq = torch.log_softmax(logits, -1).gather(1, torch.tensor(g.response_ids)[:, None]).squeeze(1)
        gap = max(gap, float((logq - torch.tensor(g.behavior_logprobs)).abs().max()))
    return gap


def run_setup(name: str, repeats: int, servers: int, workdir: Path, kind: str, python: str | None) -> None:
    hidden, layers, heads, mlp, rows, prompt_len, new_tokens = SETUPS[name]
    model_dir = save_model(workdir / name, hidden, layers, heads, mlp)
    model, tokenizer = load_policy(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, len(tokenizer), (int(n),), generator=g).tolist()
             for n in torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=g)]
    sampling = SamplingParams(max_new_tokens=new_tokens)
    local = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    launch = LaunchConfig(num_servers=servers, python=python, extra_args=VLLM_ARGS if kind == "vllm" else [],
                          env={"OMP_NUM_THREADS": "1"} if kind == "vcpo" else {})
    t_start = time.perf_counter()
    with LaunchedServers(launch, kind, model_dir, "float32", workdir / f"{name}-{servers}-logs") as launched:
        urls = launched.wait_healthy()
        startup_s = time.perf_counter() - t_start
        pool = ServerPool(urls, kind)
        check = WeightCheck(model, WeightCheck.probe(len(tokenizer)), 1e-3) if kind == "vllm" else None
        publisher = ServerWeightPublisher(pool, workdir / f"{name}-{servers}-weights", check=check)
        remote = ServerRolloutEngine(pool, publisher)
        remote.load_weights(model.state_dict(), 0)
        print(f"[{name}] {n_params / 1e6:.2f}M parameters, {rows} rows, prompts of {prompt_len // 2}-{prompt_len} "
              f"tokens, up to {new_tokens} new tokens; {servers} {kind} server(s), healthy after {startup_s:.0f} s")
        for fn in (lambda: local.generate(batch, sampling), lambda: remote.generate(batch, sampling)):
            fn()  # warm-up
        local_tps, remote_tps, ratios = [], [], []
        for r in range(repeats):
            seeded = torch.Generator().manual_seed(r)
            t_local, n_local = timed(lambda gen=seeded: local.generate(batch, sampling, generator=gen))
            t_remote, n_remote = timed(lambda: remote.generate(batch, sampling))
            local_tps.append(n_local / t_local)
            remote_tps.append(n_remote / t_remote)
            ratios.append(remote_tps[-1] / local_tps[-1])
            print(f"  round {r}: in-process {local_tps[-1]:,.0f} tok/s, through {kind} {remote_tps[-1]:,.0f} tok/s")
        print(f"[{name}] in-process {statistics.median(local_tps):,.0f} tok/s; through {servers} {kind} "
              f"{statistics.median(remote_tps):,.0f} tok/s; server/in-process ratio {statistics.median(ratios):.2f}")
        state = model.state_dict()
        update_s = []
        for v in range(1, repeats + 2):
            t0 = time.perf_counter()
            remote.load_weights(state, v)
            update_s.append(time.perf_counter() - t0)
        write_s = []
        for v in range(repeats):
            t0 = time.perf_counter()
            write_weights_dir(workdir / f"{name}-write", state, v)
            write_s.append(time.perf_counter() - t0)
        checked = "" if check is None else ", weight check"
        print(f"[{name}] weight update per step (write + pause, update, resume{checked} on {servers}): median "
              f"{statistics.median(update_s[1:]) * 1e3:.0f} ms (of which writing the directory "
              f"{statistics.median(write_s) * 1e3:.0f} ms)")
        if check is not None:
            publisher.check = None
            unchecked_s = []
            for v in range(repeats + 2, 2 * repeats + 3):
                t0 = time.perf_counter()
                remote.load_weights(state, v)
                unchecked_s.append(time.perf_counter() - t0)
            print(f"[{name}] the same without the weight check: median {statistics.median(unchecked_s) * 1e3:.0f} ms")
        if kind == "vllm":
            for temperature, top_p, greedy in [(1.0, 1.0, False), (0.7, 1.0, False), (1.0, 0.9, False),
                                               (1.0, 1.0, True)]:
                setting = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=new_tokens)
                gens = remote.generate(batch, setting, greedy=greedy)
                label = "greedy" if greedy else f"T={temperature:g} top_p={top_p:g}"
                print(f"[{name}] vLLM vs HF log-probs, {label}: max |gap| "
                      f"{processed_gap(model, batch, gens, setting, greedy):.2e} over "
                      f"{sum(len(g.response_ids) for g in gens)} tokens")
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", default="default,large")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--servers", default="1,2", help="server counts to measure, comma-separated")
    parser.add_argument("--kind", default="vcpo", choices=["vcpo", "vllm"])
    parser.add_argument("--python", default=None, help="the interpreter that has the server (vLLM: .venv-vllm)")
    args = parser.parse_args()
    configure_cpu(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.setups.split(","):
            for count in map(int, args.servers.split(",")):
                run_setup(name, args.repeats, count, Path(tmp), args.kind, args.python)


if __name__ == "__main__":
    main()
