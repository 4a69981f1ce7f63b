"""The hooks a PeerFlow plugin can implement, each written out with its contract.

Registration hooks (`peerflow_register_*`) receive a `register` callback and call it
once per class they provide; each class carries the `name` users select it by, and the
registry (`peerflow.plugins.registry`) owns naming, base-class checks and collisions. They
are called when a process builds its registries — the first time it looks a name up (the
launcher while it validates the config, then every worker as it starts), and again after
a plugin is registered directly (`PluginManager.register`) — so a hook only calls
`register`, with no other effect. Import the classes inside the hook, so listing plugins
never imports an engine.

Lifecycle hooks are called by the runtime on every rank where the event happens. Their
arguments are typed `Any` where the class lives in a package that imports this one (the
config, the engines): the docstring names the class.

Hooks evolve by gaining arguments (an implementation may accept fewer, as pluggy allows),
never by renaming. `tests/unit/test_hookspecs.py` checks that every registry kind has
exactly one hook here and that every hook documents its arguments and return value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "peerflow"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The callback a registration hook receives: `register(cls)` adds one class.
Register = Callable[[type], None]


@hookspec
def peerflow_register_rollout_engines(register: Register) -> None:
    """Register rollout (inference) engines, selected by `rollout.backend`.

    Args:
        register: Call `register(cls)` once per engine class. Each subclasses
            `peerflow.engines.RolloutEngine` (or `TensorParallelRolloutEngine`) and sets
            `name`, `capabilities` and, for an optional engine package, `requires` and
            `install_hint`.

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_rollout_engines(register):
            from my_engine.engine import MyRollout  # lazily: listing never imports it
            register(MyRollout)

    Since: 0.1.
    """


@hookspec
def peerflow_register_train_engines(register: Register) -> None:
    """Register training engines, selected by `trainer.backend`.

    Args:
        register: Call `register(cls)` once per engine class. Each subclasses
            `peerflow.engines.TrainEngine` (usually through the training toolkit's
            `peerflow.training.CausalLMTrainEngine`) and sets `name` and `capabilities`.

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_train_engines(register):
            from my_trainer.engine import MyTrainer
            register(MyTrainer)

    Since: 0.1.
    """


@hookspec
def peerflow_register_weight_transports(register: Register) -> None:
    """Register weight transports, selected by `weight_sync.transport`.

    Args:
        register: Call `register(cls)` once per transport class. Each subclasses
            `peerflow.reshard.WeightTransport` (`exchange` moves one bucket's bytes).

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_weight_transports(register):
            from my_fabric.transport import RdmaTransport
            register(RdmaTransport)

    Since: 0.1.
    """


@hookspec
def peerflow_register_rewards(register: Register) -> None:
    """Register reward functions, selected by `task.reward` (or `task.rewards`).

    Args:
        register: Call `register(cls)` once per reward class. Each subclasses
            `peerflow.algorithms.RewardFunction` (`score(responses, examples)`).

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_rewards(register):
            register(EditSimilarityReward)  # contrib/example-plugin

    Since: 0.1.
    """


@hookspec
def peerflow_register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators, selected by `algorithm.advantage`.

    Args:
        register: Call `register(cls)` once per estimator class. Each subclasses
            `peerflow.algorithms.AdvantageEstimator` (`compute(batch)`).

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_advantage_estimators(register):
            register(OPOAdvantage)  # contrib/example-plugin

    Since: 0.1.
    """


@hookspec
def peerflow_register_policy_losses(register: Register) -> None:
    """Register policy losses, selected by `algorithm.loss`.

    Args:
        register: Call `register(cls)` once per loss class. Each subclasses
            `peerflow.algorithms.PolicyLoss` (called once per micro-batch).

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_policy_losses(register):
            register(MyClippedLoss)

    Since: 0.1.
    """


@hookspec
def peerflow_register_tasks(register: Register) -> None:
    """Register tasks (prompt datasets with their default reward), selected by `task.name`.

    Args:
        register: Call `register(cls)` once per task class. Each subclasses
            `peerflow.algorithms.Task` (`examples(split, seed)`, `default_reward`).

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_tasks(register):
            register(MyMathTask)

    Since: 0.1.
    """


@hookspec
def peerflow_register_nodes(register: Register) -> None:
    """Register workflow node types, selected by `workflow.nodes[].kind`.

    Args:
        register: Call `register(cls)` once per node type. Each subclasses
            `peerflow.workflow.NodeType` (its `role`, `inputs`, `outputs`, `phase` and
            `run(batch, context)`).

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_nodes(register):
            register(LengthPenaltyNode)

    Since: 0.1.
    """


@hookspec
def peerflow_register_samplers(register: Register) -> None:
    """Register async-mode micro-batch samplers, selected by `runtime.sampler`.

    Args:
        register: Call `register(cls)` once per sampler class. Each subclasses
            `peerflow.streaming.samplers.Sampler` (`select(pool, budget, final)`).

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_samplers(register):
            register(OldestFirstSampler)

    Since: 0.2.
    """


@hookspec
def peerflow_register_environments(register: Register) -> None:
    """Register agent environments, selected by `rollout.agent.environment`.

    Args:
        register: Call `register(cls)` once per environment class. Each subclasses
            `peerflow.agents.Environment` (one instance per trajectory; see
            docs/agents.md).

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_environments(register):
            register(GuessNumber)

    Since: 0.3.
    """


@hookspec
def peerflow_register_tools(register: Register) -> None:
    """Register agent tools, selected by `rollout.agent.options.tools`.

    Args:
        register: Call `register(cls)` once per tool class. Each subclasses
            `peerflow.agents.tools.Tool` (`description`, a JSON-schema `parameters`,
            `call(arguments)`), defined at module level of an importable module.

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_register_tools(register):
            register(WordCount)

    Since: 0.3.
    """


@hookspec
def peerflow_validate_config(config: Any, pm: Any) -> list[str] | None:
    """Check a run config before any worker process starts.

    Called by `peerflow.config.validate_config` (`peerflow train`, `peerflow config
    validate`) after names and option sections are checked. For checks that span the
    run (tasks, rewards, the workflow graph). An engine refuses what it cannot build in
    its own `config_problems` classmethod instead, which is called only when it is
    selected, so it never tests `config.rollout.backend`.

    Args:
        config: The structured `peerflow.config.RunConfig`.
        pm: This process's `PluginManager` (to look up registered classes).

    Returns:
        The problems found, each naming the key and the fix; empty or `None` when the
        config is fine. Every implementation's problems are reported together.

    Example::

        @hookimpl
        def peerflow_validate_config(config):  # `pm` omitted: pluggy passes by name
            if config.task.name == "my-task" and config.rollout.sampling.n < 2:
                return ["rollout.sampling.n=1: my-task compares answers; set n >= 2"]

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

    Example::

        @hookimpl
        def peerflow_before_weight_sync(version, role, rank):
            print(f"rank {rank} ({role}): syncing version {version}")

    Since: 0.1.
    """


@hookspec
def peerflow_after_weight_sync(version: int, role: str, rank: int,
                               stats: Any) -> None:
    """Called on every rank taking part in a weight sync, after the new version is live.

    Args:
        version: The weight version now published.
        role: The role of the engine on this rank.
        rank: Global rank of this process.
        stats: A `peerflow.engines.WeightSyncStats` with time split by phase and bytes.

    Returns:
        Nothing; the return value is ignored.

    Example::

        @hookimpl
        def peerflow_after_weight_sync(version, stats):  # fewer arguments are fine
            print(f"version {version}: {stats.bytes} bytes in {stats.wire_s:.2f} s")

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

    Example::

        @hookimpl
        def peerflow_end_of_step(step, metrics, rank):
            if rank == 0:
                print(step, metrics.get("reward/mean"))

    Since: 0.1.
    """


__all__ = ["PROJECT", "Register", "hookimpl", "hookspec"]
