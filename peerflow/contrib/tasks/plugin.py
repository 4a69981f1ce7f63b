"""Registers the first-party tasks and rewards.

Entry point `tasks = peerflow.contrib.tasks.plugin`; also the first-party agent environments
(`peerflow.contrib.agents`).
"""

from __future__ import annotations

from typing import Any

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_tasks(register: Any) -> None:
    """Registers reverse-digits, arithmetic and dataset."""
    from peerflow.contrib.tasks.dataset import DatasetTask
    from peerflow.contrib.tasks.generated import ArithmeticTask, ReverseDigitsTask

    for cls in (ReverseDigitsTask, ArithmeticTask, DatasetTask):
        register(cls)


@hookimpl
def peerflow_register_rewards(register: Any) -> None:
    """Registers char_match, char_match_strict, exact_match, contains, math and code."""
    from peerflow.contrib.tasks.rewards import (
        CharMatchReward,
        CodeReward,
        ContainsReward,
        ExactMatchReward,
        MathReward,
        StrictCharMatchReward,
    )

    for cls in (CharMatchReward, StrictCharMatchReward, ExactMatchReward, ContainsReward,
                MathReward, CodeReward):
        register(cls)


@hookimpl
def peerflow_register_environments(register: Any) -> None:
    """Registers the first-party agent environments: retry."""
    from peerflow.contrib.agents.retry import RetryEnvironment

    register(RetryEnvironment)
