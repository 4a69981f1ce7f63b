"""The guess-number task and environment (the CPU agent example)."""

from __future__ import annotations

import pytest

from peerflow.agents.environment import Turn
from peerflow.agents.tool_env import ToolOptions
from peerflow.algorithms.base import Example
from peerflow.contrib.tasks.guess_number import GuessNumber, GuessNumberOptions, GuessNumberTask
from peerflow.contrib.tasks.tool_arithmetic import CalculatorArithmetic, ToolArithmeticTask


def _play(secret: str, guesses: str, **options) -> tuple[list[str], GuessNumber]:
    env = GuessNumber(Example(prompt="?", answer=secret), GuessNumberOptions(**options))
    observations = []
    for index, guess in enumerate(guesses):
        result = env.step(Turn(token_ids=[0], text=guess, index=index))
        if result.done:
            break
        observations.append(result.observation)
    return observations, env


def test_feedback_points_at_the_secret_and_finding_it_scores():
    observations, env = _play("3", "523")
    assert observations == ["<", ">"] and env.found and env.guesses == 3
    assert env.final_reward() == pytest.approx(0.8)
    assert _play("7", "7")[1].final_reward() == 1.0


def test_non_digits_and_running_out_score_nothing():
    observations, env = _play("0", "x999", max_guesses=4)
    assert observations == ["?", "<", "<"] and not env.found and env.final_reward() == 0.0


def test_task_prompts_hide_the_secret_and_cover_every_digit():
    task = GuessNumberTask(GuessNumberTask.options_class())
    examples = [task.example("train", i, seed=0) for i in range(200)]
    assert {e.prompt for e in examples} == {"?"}
    assert {e.answer for e in examples} == set("0123456789")
    with pytest.raises(ValueError, match="one digit"):
        GuessNumber(Example(prompt="?", answer="12"), GuessNumberOptions())


def test_environments_tools_and_tasks_are_registered(plugin_manager):
    assert plugin_manager.get("environment", "guess-number") is GuessNumber
    assert plugin_manager.get("environment", "calculator-arithmetic") is CalculatorArithmetic
    assert "calculator" in plugin_manager.registry("tool")
    assert plugin_manager.get("task", "guess-number") is GuessNumberTask
    assert "model.path" in ToolArithmeticTask.check_builder_options({})[0]


def test_calculator_arithmetic_scores_the_final_answer(plugin_manager):
    task = ToolArithmeticTask(ToolArithmeticTask.options_class(digits=3))
    example = task.example("train", 0, seed=0)
    env = CalculatorArithmetic(example, ToolOptions())
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculator"]
    env.step(Turn(token_ids=[0], text=f"The product is {int(example.answer):,}."))
    assert env.final_reward() == 1.0
    env.step(Turn(token_ids=[0], text="The product is 12."))
    assert env.final_reward() == 0.0
