"""Installs contrib/example-plugin with pip, uses it, uninstalls it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.fake_dist import run_peerflow

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "contrib" / "example-plugin"


def pip(*args):
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check",
                           "-q"], capture_output=True, text=True, timeout=300)


@pytest.fixture
def installed_example_plugin():
    result = pip("install", "--no-deps", "--no-build-isolation", str(PLUGIN))
    assert result.returncode == 0, result.stderr
    yield
    pip("uninstall", "-y", "peerflow-example-plugin")


def _names():
    report = json.loads(run_peerflow("plugins", "--json").stdout)
    return {p["name"]: p for p in report["plugins"]}


def test_example_plugin_is_listed_selectable_and_removable(installed_example_plugin, tmp_path):
    plugins = _names()
    assert "example" in plugins
    example = plugins["example"]
    assert example["distribution"] == "peerflow-example-plugin"
    assert example["registered"] == {"advantage_estimator": ["opo"], "reward": ["edit-similarity"],
                                     "rollout_engine": ["minimal"], "train_engine": ["ddp"]}
    config = tmp_path / "run.yaml"
    config.write_text("algorithm:\n  advantage: opo\n")
    result = run_peerflow("config", "validate", str(config), "--set", "task.reward=edit-similarity")
    assert result.returncode == 0, result.stderr
    pip("uninstall", "-y", "peerflow-example-plugin")
    assert "example" not in _names()
    result = run_peerflow("config", "validate", str(config))
    assert result.returncode != 0 and "unknown advantage estimator 'opo'" in result.stderr


def test_example_plugin_algorithms_compute_real_values():
    sys.path.insert(0, str(PLUGIN))
    try:
        import torch
        from peerflow_example_plugin.opo import OPOAdvantage
        from peerflow_example_plugin.rewards import EditSimilarityReward, levenshtein

        from peerflow.algorithms import Example
        from peerflow.batch import Batch
    finally:
        sys.path.remove(str(PLUGIN))
    assert levenshtein("kitten", "sitting") == 3
    reward = EditSimilarityReward()
    assert reward.score(["321", "32", "x"], [Example(prompt="", answer="321")] * 3) == \
        pytest.approx([1.0, 2 / 3, 0.0])
    batch = Batch(sample_id=torch.arange(3), group_id=torch.tensor([0, 0, 1]),
                  weight_version=torch.zeros(3))
    batch.set("response_ids", [torch.zeros(1), torch.zeros(3), torch.zeros(2)])
    batch.set("reward", torch.tensor([1.0, 0.0, 0.5]))
    advantages = OPOAdvantage().compute(batch)["advantages"]
    # Group 0 baseline = (1*1 + 3*0) / 4 = 0.25; group 1 has one member -> 0.
    assert advantages.row(0).tolist() == [0.75]
    assert advantages.row(1).tolist() == [-0.25] * 3
    assert advantages.row(2).tolist() == [0.0, 0.0]


@pytest.fixture
def example_plugin(plugin_manager):
    """The example plugin registered from its source folder (as its entry point would)."""
    sys.path.insert(0, str(PLUGIN))
    try:
        from peerflow_example_plugin import plugin
    finally:
        sys.path.remove(str(PLUGIN))
    plugin_manager.register(plugin, "example", distribution="peerflow-example-plugin")
    return plugin_manager


def test_example_plugin_ships_the_worked_example_engine(example_plugin):
    from peerflow.engines import RolloutEngine

    engine = example_plugin.get("rollout_engine", "minimal")
    assert issubclass(engine, RolloutEngine)
    assert engine.__module__ == "peerflow_example_plugin.engine"
    assert example_plugin.registry("rollout_engine").entries["minimal"].distribution == \
        "peerflow-example-plugin"


def test_example_engine_refuses_truncated_sampling_at_validation(example_plugin):
    from tests.helpers.configs import validation_error

    message = validation_error(example_plugin, "rollout.backend=minimal",
                               "rollout.sampling.top_p=0.9")
    assert "rollout.sampling.top_p=0.9: rollout.backend=minimal" in message
    assert "set rollout.sampling.top_p=1.0" in message


def test_an_engine_refuses_only_when_it_is_selected(example_plugin):
    """`config_problems` runs on the selected engines: hf truncates, so top_p passes."""
    from peerflow.config import load_config, validate_config

    validate_config(load_config(None, ["rollout.sampling.top_p=0.9"]), example_plugin)
