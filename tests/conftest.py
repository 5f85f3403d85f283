"""Shared test helpers: tiny batches built from explicit numbers; `vcpo` through its real command line on a
tiny warm start (cached once per session), one finished lagged run that resume tests compare against, and
finding processes a sandbox left behind."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from vcpo.metrics import METRICS_FILE, read_metrics
from vcpo.objectives import ObjectiveInputs
from vcpo.testing.faults import command_env

ROOT = Path(__file__).resolve().parents[1]
LAGGED = ["async.mode=lagged", "async.max_staleness=2", "trainer.max_steps=4"]
"""The lagged run of ``lagged_full``: 4 steps, k = 2, evaluations and checkpoints at steps 2 and 4."""


def vcpo(*args: str, check: bool = True, python: list[str] | None = None) -> subprocess.CompletedProcess:
    """``vcpo ARGS`` through the real command line (``python``: what runs it instead of ``-m vcpo.cli``, e.g. a
    ``-c`` program that injects a fault before it calls ``vcpo.cli.main``)."""
    proc = subprocess.run([sys.executable, *(python or ["-m", "vcpo.cli"]), *args], capture_output=True, text=True,
                          env=command_env(), cwd=ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"vcpo {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def patched_cli(patch: str) -> list[str]:
    """``python`` arguments for ``vcpo(...)`` that apply ``patch`` (Python source injecting a fault), then run the
    command line."""
    return ["-c", f"import sys\n{patch}\nfrom vcpo.cli import main\nsys.argv[0] = 'vcpo'\nmain()\n"]


NAN_GRADIENT_FROM_STEP_2 = """
import math
from vcpo.train.learner import Learner
backward = Learner.backward
def backward_with_a_nan(self, batch):
    metrics = backward(self, batch)
    if self.version >= 1:
        next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = math.nan
    return metrics
Learner.backward = backward_with_a_nan
"""
"""A fault for ``patched_cli``: from the second step on, one entry of the gradient is NaN (what a diverging update
produces, without depending on whether a given lr makes this machine's kernels diverge)."""


def metrics(run_dir: Path) -> list[dict]:
    """A run's metric lines ([] before its first one)."""
    path = run_dir / METRICS_FILE
    return read_metrics(path) if path.is_file() else []


@pytest.fixture(scope="session")
def tiny_overrides(tmp_path_factory) -> list[str]:
    """Overrides that make any config tiny: a few SFT steps (cached once), small batches."""
    cache = tmp_path_factory.mktemp("cache")
    return [f"sft.cache_dir={cache}", "sft.steps=30", "sft.batch_size=32", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "task.eval_size=16", "trainer.eval_every=2",
            "trainer.checkpoint_every=2", "logging.progress=false", "trainer.lr=1e-3"]


@pytest.fixture(scope="session")
def tiny(tiny_overrides) -> list[str]:
    """A tiny run of configs/quickstart.yaml."""
    return ["-c", "configs/quickstart.yaml", *tiny_overrides]


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory, tiny_overrides) -> Path:
    """The embedded default model (tied embeddings, float32) after a few SFT steps, saved as a Hugging Face
    directory: what tests/with_vllm serves with vLLM."""
    out = tmp_path_factory.mktemp("sft") / "model"
    vcpo("sft", "-c", "configs/quickstart.yaml", *tiny_overrides, "--save", str(out))
    return out


@pytest.fixture(scope="session")
def lagged_full(tmp_path_factory, tiny) -> Path:
    """An uninterrupted ``LAGGED`` run: the reference that interrupted and resumed runs must reproduce."""
    run_dir = tmp_path_factory.mktemp("lagged") / "full"
    vcpo("train", *tiny, *LAGGED, f"run_dir={run_dir}")
    return run_dir

# One intra-op thread: the tests' tiny models run several times faster single-threaded on the shared 2-core machine
# (measured: 0.08 s instead of 0.75 s per micro-batch equality test, with other jobs running).
torch.set_num_threads(1)


RAY_MODULES = {"test_ray", "test_ray_broadcast", "test_ray_config", "test_ray_learner_actor", "test_ray_multinode",
               "test_lora_sync"}
"""The modules that start Ray instances: under pytest-xdist one worker runs them one after another (two local Ray
instances at once would share this machine's ports and its address file), first, since together they are the
suite's longest unit."""


def pytest_collection_modifyitems(config, items) -> None:
    """The Ray modules first (stable otherwise): the longest unit of work starts at once."""
    items.sort(key=lambda item: item.path.stem not in RAY_MODULES)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: `make test` runs `pytest -n 2`
def pytest_xdist_make_scheduler(config, log):
    """Each module is one unit of work on one worker, so that its module-scoped servers, clusters and runs are built
    once; the Ray modules are one unit together. (xdist's ``--dist loadgroup`` would say this with marks, but it
    renames node ids in a way pytest 9.2 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if Path(module).parent.name == "gpu":  # no module-scoped state: each test on any worker
                return nodeid
            return "ray" if Path(module).stem in RAY_MODULES else module

    return ModuleScheduling(config, log)


@pytest.fixture(autouse=True)
def _default_denormals():
    """A test that runs the trainer in-process gets its flush-denormal setting (vcpo.runtime.configure_cpu);
    later tests (hypothesis' float strategies among them) expect IEEE subnormals back."""
    yield
    torch.set_flush_denormal(False)


def make_inputs(lp, blp, adv, mask=None, **extra) -> tuple[ObjectiveInputs, torch.Tensor]:
    """ObjectiveInputs from nested lists (float64); returns (inputs, the lp leaf for .grad)."""
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    blp_t = torch.tensor(blp, dtype=torch.float64)
    adv_t = torch.tensor(adv, dtype=torch.float64)
    mask_t = torch.ones_like(blp_t) if mask is None else torch.tensor(mask, dtype=torch.float64)
    conv = {}
    for k, v in extra.items():
        if v is None or isinstance(v, torch.Tensor):
            conv[k] = v
        elif k == "group_ids":
            conv[k] = torch.tensor(v, dtype=torch.long)
        else:
            conv[k] = torch.tensor(v, dtype=torch.float64)
    return ObjectiveInputs(logprobs=lp_t, behavior_logprobs=blp_t, advantages=adv_t, mask=mask_t, **conv), lp_t


LN2 = math.log(2.0)

# A small Jinja chat template in the style of ChatML, written with characters of the embedded tokenizer.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def processes_with(marker: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != b"Z":
            found.append(int(pid))
    return found


def sleeper_code(marker: str, detach: bool) -> str:
    """A program that leaves a 60 s sleeper behind (after setsid and a double fork when ``detach``)."""
    spawn = f'os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])'
    if detach:
        return ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                f"        {spawn}\n    os._exit(0)\nos.wait()\n")
    return f"import os, sys\nif os.fork() == 0:\n    {spawn}\n"


def save_tiny_policy(out: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 32) with the default model's character tokenizer, saved as a Hugging Face
    directory: what `vcpo serve` and `model.path` load in the server tests (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer

    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world_size: int, *args, timeout_s: float = 400) -> None:
    """``target(rank, world_size, port, *args)`` in ``world_size`` spawned processes (a torch.distributed group on
    127.0.0.1:port); each must exit 0 within ``timeout_s``, and none is left running whatever happens."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, *args), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout_s)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


@contextmanager
def serving(model_dir: Path, count: int = 1, timeout_s: float = 120.0) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """``count`` `vcpo serve` processes on free localhost ports, healthy before the body runs; each is killed when the
    body ends, also when it fails (and dies with the test process if that is killed first)."""
    import httpx

    from vcpo.runtime import set_parent_death_signal  # SIGKILL when the test process dies, however it dies

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs: list[tuple[str, subprocess.Popen]] = []
    logs: list = []
    try:
        for _ in range(count):
            port = free_port()
            log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty server can never block on it
            logs.append(log)
            proc = subprocess.Popen([sys.executable, "-m", "vcpo.cli", "serve", str(model_dir), "--port", str(port)],
                                    env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                                    preexec_fn=set_parent_death_signal)
            procs.append((f"http://127.0.0.1:{port}", proc))
        deadline = time.monotonic() + timeout_s
        for (url, proc), log in zip(procs, logs, strict=True):
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise AssertionError(f"vcpo serve exited ({proc.returncode}): {log.read()[-2000:]!r}")
                try:
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"vcpo serve at {url} not healthy within {timeout_s} s")
                time.sleep(0.2)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
