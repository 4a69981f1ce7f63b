"""The agent examples under `peerflow train`: guess-number (2 processes) and the JSON
tool-calling example on a tiny random Qwen2 with a tool-calling chat template."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.distributed

GUESS_NUMBER = str(ROOT / "examples" / "agents" / "guess_number.yaml")
TOOL_CALCULATOR = str(ROOT / "examples" / "agents" / "tool_calculator.yaml")
SMALL = ["run.trace=false", "run.tensorboard=false", "model.builder_options.hidden_size=32",
         "model.builder_options.intermediate_size=64", "model.builder_options.num_layers=1"]


def test_guess_number_example_runs(tmp_path, metrics_of, peerflow_train):
    run_dir = tmp_path / "run"
    peerflow_train([GUESS_NUMBER, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*SMALL, "run.steps=3", "run.prompts_per_step=8", "rollout.sampling.n=4"])
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert 0.0 <= m["reward/min"] <= m["reward/mean"] <= m["reward/max"] <= 1.0
        assert 1.0 <= m["agent/turns_mean"] <= m["agent/turns_max"] <= 4.0
        # One sampled digit a turn: model tokens per trajectory = turns.
        assert m["response_length/mean"] == pytest.approx(m["agent/turns_mean"])
        assert m["agent/finish/stop"] + m["agent/finish/max_turns"] == pytest.approx(1.0)
        assert m["agent/finish/env_error"] == 0.0 and m["agent/finish/env_timeout"] == 0.0
        # One feedback character between two guesses.
        assert m["agent/observation_tokens"] <= 32 * (m["agent/turns_max"] - 1)


def test_tool_calculator_example_runs_on_a_tiny_chat_model(tmp_path, metrics_of,
                                                           peerflow_train):
    from tests.helpers.chat_model import build_chat_model

    model = build_chat_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    peerflow_train([TOOL_CALCULATOR, "--run-dir", str(run_dir)],
                   [f"model.path={model}", "run.steps=1", "run.prompts_per_step=2",
                    "rollout.sampling.n=2", "rollout.sampling.max_tokens=8",
                    "rollout.agent.max_turns=2", "run.trace=false", "run.tensorboard=false"])
    (m,) = metrics_of(run_dir)
    assert m["reward/mean"] == 0.0  # a random model answers no product
    assert 1.0 <= m["agent/turns_mean"] <= 2.0
    assert m["agent/finish/env_error"] == 0.0
