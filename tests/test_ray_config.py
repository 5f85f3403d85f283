"""The Ray backend's configuration, without starting Ray: its keys' one-line errors, Ray imported only when chosen
and a one-line error naming the extra when it is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vcpo.config import ConfigError, load_config

from conftest import vcpo


@pytest.mark.parametrize(("overrides", "message"), [
    (["async.backend=ray", "async.mode=lagged"], "async.backend=ray needs async.mode=async (got 'lagged')"),
    (["async.backend=ray", "trainer.num_learners=5", "rollout.prompts_per_step=4"],
     "trainer.num_learners=5 exceeds the groups per step (4): each rank trains on whole groups"),
    (["async.backend=spark"], "config key 'async.backend'"),
    (["ray.timeout_s=0"], "config key 'ray.timeout_s'"),
    (["ray.weight_sync=nccl"], "config key 'ray.weight_sync'"),
    (["ray.rollout_resources={GPU: 1}"], "config key 'ray.rollout_resources': GPU is set by ray.worker_num_cpus/gpus "
                                         "and ray.learner_num_cpus/gpus, not as a custom resource"),
    (["ray.learner_resources={learner: 0}"], "config key 'ray.learner_resources': resource 'learner' needs an amount "
                                             "> 0 (got 0)"),
    (["ray.learner_placement=ring"], "config key 'ray.learner_placement'"),
    (["ray.start_timeout_s=0"], "config key 'ray.start_timeout_s'"),
    (["async.backend=ray", "ray.weight_sync=broadcast", "rollout.engine=server", "rollout.server.urls=[http://h:1]"],
     "ray.weight_sync=broadcast is for in-process rollout actors: with rollout.engine=server the servers get the "
     "weights through rollout.server"),
])
def test_bad_backend_settings_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_the_cli_exits_2_with_one_line_before_anything_heavy(tmp_path):
    proc = vcpo("train", "async.mode=sync", "async.backend=ray", f"run_dir={tmp_path / 'r'}", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: async.backend=ray needs async.mode=async (got 'sync')"


def test_ray_is_imported_only_when_chosen_and_its_absence_is_one_line():
    code = ("import sys\n"
            "import vcpo.loop.trainer, vcpo.cli\n"
            "assert 'ray' not in sys.modules, 'the trainer imported ray'\n"
            "sys.modules['ray'] = None  # as if the extra were not installed\n"
            "from vcpo.config import ConfigError, load_config\n"
            "from vcpo.orchestration.ray.session import RaySession\n"
            "try:\n"
            "    RaySession(load_config(None, ['async.backend=ray']))\n"
            "except ConfigError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == 'async.backend=ray needs Ray: pip install -e ".[ray]"'


def test_a_local_instance_is_given_the_custom_resources_the_actors_ask_for():
    config = load_config(None, ["async.backend=ray", "async.num_workers=3", "trainer.num_learners=2",
                                "rollout.prompts_per_step=4", "ray.rollout_resources={rollout: 1, fast: 0.5}",
                                "ray.learner_resources={fast: 1}"])
    assert config.ray.demands(3, 2) == {"rollout": 3.0, "fast": 3.5}


def test_a_null_address_starts_an_instance_of_its_own_whatever_cluster_the_environment_names():
    """``ray.address: null`` is a local instance even where ray.init() alone would join another cluster: one named by
    RAY_ADDRESS (here an address with nothing behind it) or by the address file of a running ``ray start``."""
    code = ("import ray\n"
            "from vcpo.config import load_config\n"
            "from vcpo.orchestration.ray.session import RaySession\n"
            "with RaySession(load_config(None, ['async.backend=ray', 'ray.num_cpus=1'])) as session:\n"
            "    print(session.owned, ray.cluster_resources()['CPU'], ray.get(ray.remote(lambda: 7).remote()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RAY_ADDRESS": "127.0.0.1:9"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "1.0", "7"]
