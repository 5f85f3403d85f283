"""Rollout throughput through `vcpo serve` (HTTP, the server engine) against the in-process HF engine, and the
time of one weight update through the servers (safetensors directory + pause, update_weights, resume).

Both sample the same batches (random-initialised Llama models built locally, one torch thread per process) at
temperature 1 for up to ``max_new_tokens`` tokens; tokens/s counts the response tokens actually generated (a
random model says EOS now and then). In-process and HTTP rounds alternate after a warm-up; the last lines per
setup give the median tokens/s of each and the median of the per-round ratios, then the update times.

    python benchmarks/serve_throughput.py                         # default model and a 20M Llama, 1 and 2 servers
    python benchmarks/serve_throughput.py --setups default --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
from vcpo.rollout.server import ServerRolloutEngine, ServerWeightPublisher
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


def start_servers(model_dir: Path, count: int) -> list[tuple[str, subprocess.Popen]]:
    procs = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for port in range(18931, 18931 + count):
        proc = subprocess.Popen([sys.executable, "-m", "vcpo.cli", "serve", str(model_dir), "--port", str(port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append((f"http://127.0.0.1:{port}", proc))
    for url, proc in procs:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vcpo serve at {url} did not start") from None
            time.sleep(0.2)
    return procs


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = sum(len(g.response_ids) for g in fn())
    return time.perf_counter() - t0, tokens


def run_setup(name: str, repeats: int, servers: int, workdir: Path) -> None:
    hidden, layers, heads, mlp, rows, prompt_len, new_tokens = SETUPS[name]
    model_dir = save_model(workdir / name, hidden, layers, heads, mlp)
    model, tokenizer = load_policy(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, len(tokenizer), (int(n),), generator=g).tolist()
             for n in torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=g)]
    sampling = SamplingParams(max_new_tokens=new_tokens)
    local = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    procs = start_servers(model_dir, servers)
    try:
        pool = ServerPool([u for u, _ in procs])
        remote = ServerRolloutEngine(pool, ServerWeightPublisher(pool, workdir / f"{name}-{servers}-weights"))
        print(f"[{name}] {n_params / 1e6:.2f}M parameters, {rows} rows, prompts of {prompt_len // 2}-{prompt_len} "
              f"tokens, up to {new_tokens} new tokens; {servers} server(s)")
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
            print(f"  round {r}: in-process {local_tps[-1]:,.0f} tok/s, through vcpo serve {remote_tps[-1]:,.0f} tok/s")
        print(f"[{name}] in-process {statistics.median(local_tps):,.0f} tok/s; through {servers} vcpo serve "
              f"{statistics.median(remote_tps):,.0f} tok/s; serve/in-process ratio {statistics.median(ratios):.2f}")
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
        print(f"[{name}] weight update per step (write + pause, update_weights, resume on {servers}): median "
              f"{statistics.median(update_s[1:]) * 1e3:.0f} ms (of which writing the directory "
              f"{statistics.median(write_s) * 1e3:.0f} ms)")
        pool.close()
    finally:
        for _, proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", default="default,large")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--servers", default="1,2", help="server counts to measure, comma-separated")
    args = parser.parse_args()
    configure_cpu(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.setups.split(","):
            for count in map(int, args.servers.split(",")):
                run_setup(name, args.repeats, count, Path(tmp))


if __name__ == "__main__":
    main()
