"""The sharded learner on CUDA (issue 39): one FSDP2 rank (NCCL, world size 1: a machine with one GPU cannot hold
two NCCL ranks) against one unsharded learner on the same batch, in bfloat16 with float32 master weights, on a Llama
saved locally with random weights: the step's metrics, the updated master weights, each learner's peak GPU memory and
step time, and the time of one layer-by-layer gather of the sharded weights into a host mirror.

    python benchmarks/sharded_cuda_check.py                   # CUDA
    python benchmarks/sharded_cuda_check.py --device cpu      # gloo on the CPU: a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from sharded_memory import make_batch, save_model

from vcpo.config import load_config
from vcpo.models.loading import load_policy
from vcpo.train.data_parallel import init_process_group
from vcpo.train.learner import Learner
from vcpo.train.sharding import ShardedLearner, build_sharded_model, gathered_layers

SHAPES = {"cuda": (1024, 24, 2816, 16, 32000), "cpu": (128, 2, 384, 4, 1000)}  # hidden, layers, inter, heads, vocab


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def timed_step(learner, batch, device: torch.device) -> tuple[dict, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics = learner.step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return metrics, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    device = torch.device(args.device)
    from vcpo.rollout.launch import free_port

    init_process_group(0, 1, "127.0.0.1", free_port(), 300)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    overrides = ["objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast",
                 f"model.dtype={dtype}", "rollout.prompts_per_step=8", "rollout.group_size=2"]
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(SHAPES[args.device], Path(tmp) / "model")
        model = load_policy(model_dir, dtype, device)[0]
        batch = make_batch(model.config.vocab_size)
        out["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
        reference = Learner(model, load_config(None, overrides))
        reference_metrics, out["unsharded_step_s"] = timed_step(reference, batch, device)
        out["unsharded_peak_GiB"] = peak_gib(device)
        masters = {name: (m if m is not None else p).detach().float().cpu() for (name, p), m in
                   zip(((n, p) for n, p in model.named_parameters() if p.requires_grad), reference.optimizer.masters,
                       strict=True)}
        del reference, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        config = load_config(None, [*overrides, "trainer.num_learners=2", "trainer.sharding=fsdp"])
        sharded = ShardedLearner(build_sharded_model(str(model_dir), config, device), config)
        sharded_metrics, out["sharded_step_s"] = timed_step(sharded, batch, device)
        out["sharded_peak_GiB"] = peak_gib(device)
        for key in ("loss/value", "grad_norm", "ess/ratio", "opob/grad_sq_norm_mean"):
            out[f"{key} (unsharded, sharded)"] = (reference_metrics[key], sharded_metrics[key])
        worst = 0.0
        for name, param in sharded.model.named_parameters():
            value = param.full_tensor().float().cpu()
            worst = max(worst, float((value - masters[name]).norm() / masters[name].norm()))
        out["updated_weights_max_rel_diff"] = worst
        t0 = time.perf_counter()
        for layer in gathered_layers(sharded.model):
            for value in layer.values():
                value.to(dtype=torch.bfloat16, device="cpu")
        out["gather_to_host_s"] = time.perf_counter() - t0
    print(json.dumps(out, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
