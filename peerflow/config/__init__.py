"""Run configuration: attrs classes, YAML files, typed `--set` overrides, validation.

`validate_config` checks names and option sections, then every `peerflow_validate_config`
hook implementation (the core registers its own like a plugin: the planner's graph and
layout checks, the algorithms', the rewards').
"""

from peerflow.config.engines import (
    AgentConfig,
    LayoutConfig,
    RolloutConfig,
    SamplingConfig,
    TrainerConfig,
    WeightSyncConfig,
)
from peerflow.config.loader import (
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
from peerflow.config.workflow import NodeConfig, WorkflowConfig

__all__ = [
    "AgentConfig",
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
