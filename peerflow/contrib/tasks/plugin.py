"""Registers the first-party tasks, rewards and agent environments.

The agent layer's own environments (`tools`, `agent-program`) and the `calculator` tool
are the core's (`peerflow.agents.plugin`).

Entry point `tasks = peerflow.contrib.tasks.plugin`.
"""

from __future__ import annotations

from typing import Any

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_tasks(register: Any) -> None:
    """Registers the first-party tasks, reasoning-gym, textarena and verifiers among them.

    reverse-digits, arithmetic, dataset, guess-number, tool-arithmetic; the libraries of
    reasoning-gym, textarena and verifiers are imported only when a run uses them.
    """
    from peerflow.contrib.ecosystem.reasoning_gym import ReasoningGymTask
    from peerflow.contrib.ecosystem.textarena import TextArenaTask
    from peerflow.contrib.ecosystem.verifiers import VerifiersTask
    from peerflow.contrib.tasks.dataset import DatasetTask
    from peerflow.contrib.tasks.generated import ArithmeticTask, ReverseDigitsTask
    from peerflow.contrib.tasks.guess_number import GuessNumberTask
    from peerflow.contrib.tasks.tool_arithmetic import ToolArithmeticTask

    for cls in (ReverseDigitsTask, ArithmeticTask, DatasetTask, GuessNumberTask,
                ToolArithmeticTask, ReasoningGymTask, TextArenaTask, VerifiersTask):
        register(cls)


@hookimpl
def peerflow_register_environments(register: Any) -> None:
    """Registers the first-party agent environments.

    guess-number, calculator-arithmetic, retry, textarena, openenv, environment-factory and
    verifiers.
    """
    from peerflow.contrib.ecosystem.openenv import OpenEnvEnvironment
    from peerflow.contrib.ecosystem.textarena import TextArenaEnvironment
    from peerflow.contrib.ecosystem.tool_episodes import EnvironmentFactory
    from peerflow.contrib.ecosystem.verifiers import VerifiersEnvironment
    from peerflow.contrib.tasks.guess_number import GuessNumber
    from peerflow.contrib.tasks.retry import RetryEnvironment
    from peerflow.contrib.tasks.tool_arithmetic import CalculatorArithmetic

    for cls in (GuessNumber, CalculatorArithmetic, RetryEnvironment, TextArenaEnvironment,
                OpenEnvEnvironment, EnvironmentFactory, VerifiersEnvironment):
        register(cls)


@hookimpl
def peerflow_register_rewards(register: Any) -> None:
    """Registers char_match, char_match_strict, exact_match, contains, math, code, reasoning_gym."""
    from peerflow.contrib.ecosystem.reasoning_gym import ReasoningGymReward
    from peerflow.contrib.tasks.rewards import (
        CharMatchReward,
        CodeReward,
        ContainsReward,
        ExactMatchReward,
        MathReward,
        StrictCharMatchReward,
    )

    for cls in (CharMatchReward, StrictCharMatchReward, ExactMatchReward, ContainsReward,
                MathReward, CodeReward, ReasoningGymReward):
        register(cls)
