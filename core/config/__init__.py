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
    KLConfig,
    ModelConfig,
    RunConfig,
    RunSettings,
    RuntimeConfig,
    TaskConfig,
)
from peerflow.config.structure import apply_override, structure, unstructure

__all__ = [
    "EXTRA_VALIDATORS",
    "AlgorithmConfig",
    "KLConfig",
    "LayoutConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "RunSettings",
    "RuntimeConfig",
    "SamplingConfig",
    "TaskConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "apply_override",
    "dump_config",
    "load_config",
    "load_raw",
    "structure",
    "structure_options",
    "unstructure",
    "validate_config",
]
