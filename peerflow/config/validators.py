"""The core's config validators, registered like a plugin's (`peerflow_validate_config`).

`peerflow.config.validate_config` checks names and option sections itself, then asks
every `peerflow_validate_config` implementation for problems. These are the built-in
ones; each imports its subsystem only when called, so the config package depends on
none of them.
"""

from __future__ import annotations

from typing import Any

from peerflow.errors import ConfigError, PeerFlowError
from peerflow.plugins.hookspecs import hookimpl


def _async_program(config: Any, pm: Any) -> list[str]:
    """Settings `runtime.mode: async` cannot run (the planner's async program refuses them)."""
    if config.runtime.mode != "async":
        return []
    from peerflow.planner import plan_run

    try:
        plan_run(config, config.runtime.nprocs, pm)
    except ConfigError as exc:
        return [str(exc)]
    return []


def _checks() -> list[Any]:
    from peerflow.algorithms import check_model_builder
    from peerflow.algorithms.setup import check_algorithm
    from peerflow.planner.validate import validate_workflow
    from peerflow.rewards import check_rewards

    return [validate_workflow, check_model_builder, check_algorithm, _async_program,
            check_rewards]


@hookimpl
def peerflow_validate_config(config: Any, pm: Any) -> list[str]:
    """The workflow and layouts, the model builder, the algorithm, async mode, rewards."""
    problems: list[str] = []
    for check in _checks():
        try:
            problems += check(config, pm)
        except PeerFlowError as exc:
            problems.append(str(exc))
    return problems
