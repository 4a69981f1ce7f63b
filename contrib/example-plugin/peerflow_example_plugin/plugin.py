"""Entry point `example` in group `peerflow`: what the example plugin registers.

The classes are imported inside the hooks, so `peerflow plugins` lists the plugin without
importing its engine (and transformers).
"""

from __future__ import annotations

from peerflow.plugins import hookimpl
from peerflow.plugins.hookspecs import Register


@hookimpl
def peerflow_register_rollout_engines(register: Register) -> None:
    """Registers the `minimal` rollout engine."""
    from peerflow_example_plugin.engine import MinimalRollout

    register(MinimalRollout)


@hookimpl
def peerflow_register_rewards(register: Register) -> None:
    """Registers `edit-similarity`."""
    from peerflow_example_plugin.rewards import EditSimilarityReward

    register(EditSimilarityReward)


@hookimpl
def peerflow_register_advantage_estimators(register: Register) -> None:
    """Registers `opo`."""
    from peerflow_example_plugin.opo import OPOAdvantage

    register(OPOAdvantage)



@hookimpl
def peerflow_register_train_engines(register: Register) -> None:
    """Registers the `ddp` train engine."""
    from peerflow_example_plugin.trainer import DDPTrainEngine

    register(DDPTrainEngine)
