"""Training-inference mismatch and ESS at k = 0: short synchronous runs of the quickstart setup in float32 and
bfloat16, each with and without the float32 LM head (``model.lm_head_fp32``).

In ``sync`` mode every token is sampled by the weights the learner then differentiates, so
``mismatch/logprob_abs_{max,mean}`` (|learner - engine log-prob|) and ``ess/ratio`` measure only the numerical
difference between the engine's KV-cache decode and the learner's full forward. Prints the mean over steps of
each metric and the largest per-step max.

    python benchmarks/mismatch.py                       # the embedded default model, CPU, 10 steps per run
    python benchmarks/mismatch.py model.device=cuda model.path=/path/to/local/model --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from vcpo.config import load_config
from vcpo.loop.trainer import train
from vcpo.metrics import METRICS_FILE, read_metrics

VARIANTS = {
    "float32": ["model.dtype=float32", "model.lm_head_fp32=false"],
    "float32 + fp32 head": ["model.dtype=float32", "model.lm_head_fp32=true"],
    "bfloat16": ["model.dtype=bfloat16", "model.lm_head_fp32=false"],
    "bfloat16 + fp32 head": ["model.dtype=bfloat16", "model.lm_head_fp32=true"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(f"{'variant':<22}{'mismatch max':>14}{'mismatch mean':>15}{'ess/ratio':>11}{'ess min':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, variant in VARIANTS.items():
            run_dir = Path(tmp) / name.replace(" ", "_")
            config = load_config(args.config, [
                "async.mode=sync", "async.max_staleness=0", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
                "trainer.checkpoint_every=0", "logging.progress=false", f"run_dir={run_dir}", "task.eval_size=16",
                *variant, *args.overrides,
            ])
            train(config)
            lines = read_metrics(run_dir / METRICS_FILE)
            worst = max(m["mismatch/logprob_abs_max"] for m in lines)
            mean = statistics.mean(m["mismatch/logprob_abs_mean"] for m in lines)
            ess = [m["ess/ratio"] for m in lines]
            print(f"{name:<22}{worst:>14.3g}{mean:>15.3g}{statistics.mean(ess):>11.6f}{min(ess):>9.6f}", flush=True)


if __name__ == "__main__":
    main()
