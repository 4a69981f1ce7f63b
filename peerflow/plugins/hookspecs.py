"""The hooks a PeerFlow plugin can implement.

Registration hooks (`peerflow_register_*`) receive a `register` callback and call it
once per class they provide; each class carries the `name` users select it by, and the
registry owns naming and collision policy. Lifecycle hooks are called by the runtime on
every rank where the event happens. Hooks evolve by gaining arguments (an
implementation may accept fewer), never by renaming.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "peerflow"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def peerflow_register_rollout_engines(register: Any) -> None:
    """Register rollout (inference) engine adapters.

    Args:
        register: Call `register(cls)` for each `peerflow.RolloutEngine` subclass; the
            class's `name` is what `rollout.backend` selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_register_train_engines(register: Any) -> None:
    """Register train engine adapters.

    Args:
        register: Call `register(cls)` for each `peerflow.TrainEngine` subclass; the
            class's `name` is what `trainer.backend` selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_register_weight_transports(register: Any) -> None:
    """Register transports that move weight buckets from trainer to rollout ranks.

    Args:
        register: Call `register(cls)` for each transport class; its `name` is what
            `weight_sync.transport` selects (built-ins: in-process copy,
            torch.distributed, CUDA IPC).

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_register_rewards(register: Any) -> None:
    """Register reward functions.

    Args:
        register: Call `register(cls)` for each `peerflow.algorithms.RewardFunction`
            subclass; its `name` is what `reward.name` (or a `reward` node) selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_register_advantage_estimators(register: Any) -> None:
    """Register advantage estimators (GRPO, GAE, RLOO, …).

    Args:
        register: Call `register(cls)` for each `peerflow.algorithms.AdvantageEstimator`
            subclass; its `name` is what `algorithm.advantage` selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_register_policy_losses(register: Any) -> None:
    """Register policy losses (PPO-clip, GSPO, …).

    Args:
        register: Call `register(cls)` for each `peerflow.algorithms.PolicyLoss`
            subclass; its `name` is what `algorithm.loss` selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_register_tasks(register: Any) -> None:
    """Register tasks: prompt datasets paired with a default reward.

    Args:
        register: Call `register(cls)` for each `peerflow.algorithms.Task` subclass; its
            `name` is what `task.name` selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_register_nodes(register: Any) -> None:
    """Register user workflow-graph node types.

    Args:
        register: Call `register(cls)` for each node class; its `name` is what a node's
            `kind` in `workflow.nodes` selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_register_samplers(register: Any) -> None:
    """Register async-mode micro-batch samplers.

    Args:
        register: Call `register(cls)` for each `peerflow.streaming.samplers.Sampler`
            subclass; its `name` is what `runtime.sampler` selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.2.
    """


@hookspec
def peerflow_register_environments(register: Any) -> None:
    """Register multi-turn agent environments (tools are environments too).

    Args:
        register: Call `register(cls)` for each `peerflow.agents.Environment` subclass;
            its `name` is what `rollout.agent.environment` selects.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.3.
    """


@hookspec
def peerflow_register_tools(register: Any) -> None:
    """Register tools that a `ToolEnvironment` offers the model (`peerflow.agents.Tool`).

    Args:
        register: Call `register(cls)` for each `peerflow.agents.Tool` subclass; its
            `name` is what `rollout.agent.options.tools` lists and what the model calls.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.3.
    """


@hookspec
def peerflow_validate_config(config: Any, pm: Any) -> list[str] | None:
    """Check a run config before any worker process starts.

    Called by `peerflow.config.validate_config` (`peerflow train`, `peerflow config
    validate`) after names and option sections are checked.

    Args:
        config: The structured `peerflow.config.RunConfig`.
        pm: This process's `PluginManager` (to look up registered classes).

    Returns:
        The problems found, each naming the key and the fix; empty or `None` when the
        config is fine. Every implementation's problems are reported together.

    Since: 0.2.
    """


@hookspec
def peerflow_before_weight_sync(version: int, role: str, rank: int) -> None:
    """Called on every rank taking part in a weight sync, before any bucket moves.

    Args:
        version: The weight version about to be published.
        role: The role of the engine on this rank (`actor`, `rollout`, …).
        rank: Global rank of this process.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_after_weight_sync(version: int, role: str, rank: int, stats: Any) -> None:
    """Called on every rank taking part in a weight sync, after the new version is live.

    Args:
        version: The weight version now published.
        role: The role of the engine on this rank.
        rank: Global rank of this process.
        stats: A `peerflow.engines.WeightSyncStats` with time split by phase and bytes.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_end_of_step(step: int, metrics: dict[str, float], rank: int) -> None:
    """Called on every rank when a training step ends.

    Args:
        step: The step that just finished (1-based).
        metrics: The step's metrics as written to `metrics.jsonl` (read-only).
        rank: Global rank of this process.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """
