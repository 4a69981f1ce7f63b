"""Engine contracts: the abstract rollout and train engines every adapter implements."""

from peerflow.engines.base import EngineContext, EngineInfo, NoOptions, WeightSyncStats
from peerflow.engines.rollout import (
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
)
from peerflow.engines.train import LossFunction, OptimSettings, SavedShard, TrainEngine

__all__ = [
    "EngineContext",
    "EngineInfo",
    "GenerationRequest",
    "GenerationResult",
    "LossFunction",
    "NoOptions",
    "OptimSettings",
    "RolloutEngine",
    "SamplingParams",
    "SavedShard",
    "TrainEngine",
    "WeightSyncStats",
]
