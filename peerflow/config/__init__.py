"""Run configuration: attrs classes, YAML files, typed `--set` overrides, validation."""

from peerflow.config.engines import (
    LayoutConfig,
    RolloutConfig,
    SamplingConfig,
    TrainerConfig,
    WeightSyncConfig,
)
from peerflow.config.loader import (
    EXTRA_VALIDATORS,
    dump_config,
    load_config,
    load_raw,
    structure_options,
    validate_config,
)
from peerflow.config.schema import (
    AlgorithmConfig,
    EvalConfig,
    KLConfig,
    ModelConfig,
    OffPolicyConfig,
    OverlongConfig,
    RewardEntry,
    RewardLimits,
    RunConfig,
    RunSettings,
    RuntimeConfig,
    TaskConfig,
)
from peerflow.config.structure import apply_override, structure, unstructure
from peerflow.config.workflow import NodeConfig, WorkflowConfig, check_workflow


def check_model_builder(config: RunConfig, pm: object) -> list[str]:
    """`EXTRA_VALIDATORS` entry: `model.builder_options` checked by the task's builder."""
    from peerflow.algorithms import check_model_builder as check

    return check(config, pm)


def check_algorithm(config: RunConfig, pm: object) -> list[str]:
    """`EXTRA_VALIDATORS` entry: stale samples need an off-policy correction, and more."""
    from peerflow.algorithms.setup import check_algorithm as check

    return check(config, pm)


def check_async_mode(config: RunConfig, pm: object) -> list[str]:
    """`EXTRA_VALIDATORS` entry: settings `runtime.mode: async` cannot run, before spawn."""
    if config.runtime.mode != "async":
        return []
    from peerflow.errors import ConfigError
    from peerflow.planner import plan_run
    from peerflow.worker.async_loop import check_async_config

    try:
        check_async_config(config, plan_run(config, config.runtime.nprocs, pm).roles)
    except ConfigError as exc:
        return [str(exc)]
    return []


def check_rewards(config: RunConfig, pm: object) -> list[str]:
    """`EXTRA_VALIDATORS` entry: every reward loads, with a usable signature, before spawn."""
    from peerflow.rewards import check_rewards as check

    return check(config, pm)


EXTRA_VALIDATORS += [check_workflow, check_model_builder, check_algorithm, check_async_mode,
                     check_rewards]

__all__ = [
    "EXTRA_VALIDATORS",
    "AlgorithmConfig",
    "EvalConfig",
    "KLConfig",
    "LayoutConfig",
    "ModelConfig",
    "NodeConfig",
    "OffPolicyConfig",
    "OverlongConfig",
    "RewardEntry",
    "RewardLimits",
    "RolloutConfig",
    "RunConfig",
    "RunSettings",
    "RuntimeConfig",
    "SamplingConfig",
    "TaskConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "WorkflowConfig",
    "apply_override",
    "dump_config",
    "load_config",
    "load_raw",
    "structure",
    "structure_options",
    "unstructure",
    "validate_config",
]
