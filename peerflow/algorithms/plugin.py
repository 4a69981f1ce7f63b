"""Registers the built-in advantage estimators and policy losses, and checks configs.

Entry point `algorithms = peerflow.algorithms.plugin`: they register exactly as a
third-party plugin would.
"""

from __future__ import annotations

from typing import Any

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_advantage_estimators(register: Any) -> None:
    """Registers grpo, rloo, reinforce_pp and gae."""
    from peerflow.algorithms.advantages import GRPO, RLOO, ReinforcePP
    from peerflow.algorithms.gae import GAE

    for cls in (GRPO, RLOO, ReinforcePP, GAE):
        register(cls)


@hookimpl
def peerflow_register_policy_losses(register: Any) -> None:
    """Registers ppo_clip and gspo."""
    from peerflow.algorithms.losses import GSPO, PPOClip

    for cls in (PPOClip, GSPO):
        register(cls)


@hookimpl
def peerflow_validate_config(config: Any, pm: Any) -> list[str]:
    """The task's model builder options, and algorithm settings the run cannot use."""
    from peerflow.algorithms.setup import check_algorithm, check_model_builder

    return check_model_builder(config, pm) + check_algorithm(config, pm)
