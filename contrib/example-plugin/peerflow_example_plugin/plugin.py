"""Entry point `example` in group `peerflow`: what the example plugin registers.

The classes are imported inside the hooks, so `peerflow plugins` lists the plugin without
importing its engine (and transformers).
"""

from __future__ import annotations

from typing import Any

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
def peerflow_validate_config(config: Any) -> list[str]:
    """Refuses, before any process starts, the sampling settings `minimal` cannot honour.

    No `Capabilities` flag covers top-p/top-k truncation, so the plugin says it here;
    `MinimalRollout.generate` raises the same refusal for direct callers.
    """
    if config.rollout.backend != "minimal":
        return []
    sampling = config.rollout.sampling
    return [f"rollout.sampling.{key}={value}: rollout.backend=minimal samples from the full "
            f"tempered distribution; set rollout.sampling.{key}={off} (or pick a backend "
            "that truncates, e.g. hf)."
            for key, value, off in (("top_p", sampling.top_p, 1.0), ("top_k", sampling.top_k, 0))
            if value != off]
