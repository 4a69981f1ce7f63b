"""`config validate` reports every problem of a config at once (issue 33, ranked item 8)."""

from __future__ import annotations

import argparse

import pytest

from peerflow.config import load_config
from peerflow.errors import ConfigError

BAD = """
trainer:
  lrr: 1.0e-6
  grad_clip: -1
  layout: {dp: two}
rollout:
  sampling: {temperature: 0, n: 4}
task:
  name: reverse-digit
  rewards: [{fn: contains, weight: heavy}, {fn: exact_match, wieght: 1}]
run: {steps: many, samples_per_step: -2}
"""


def _validate(path) -> str:
    from peerflow.cli.config_cmd import load_validated

    with pytest.raises(ConfigError) as info:
        load_validated(argparse.Namespace(config=str(path), overrides=[]))
    return str(info.value)


def test_every_problem_is_reported_at_once_with_its_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    lines = _validate(path).splitlines()
    expected = [
        "trainer.lrr: unknown key. Did you mean 'lr'?",
        "trainer: 'grad_clip' must be >= 0.0: -1.0",
        "trainer.layout.dp: expected an integer, got 'two' (str)",
        "rollout.sampling: rollout.sampling.temperature=0.0: a training run needs",
        "task.rewards[0].weight: expected a number, got 'heavy' (str)",
        "task.rewards[1].wieght: unknown key. Did you mean 'weight'?",
        "run.steps: expected an integer, got 'many' (str)",
        "run: 'samples_per_step' must be >= 0: -2",
        "unknown task 'reverse-digit'",  # the registry's check runs on the rest
    ]
    for start in expected:
        assert any(start in line for line in lines), (start, lines)


def test_a_single_problem_reads_as_before():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.gradclip=1"])
    assert str(info.value).startswith("trainer.gradclip: unknown key. Did you mean 'grad_clip'?")
    assert "\n" not in str(info.value)
