"""Engine contracts: the abstract rollout and train engines every adapter implements.

The bases an author builds on: `RolloutEngine` (one engine per rank, SPMD),
`TensorParallelRolloutEngine` (an engine that drives its own tensor-parallel workers from
one rank per replica, like vLLM and SGLang), `TrainEngine` (and, in the training toolkit,
`peerflow.training.CausalLMTrainEngine`, which supplies micro-batching, log-probs and the
default `train_step`), all on `EngineBase` (name, capabilities, options, requirements).
The worked example is `contrib/example-plugin` (CONTRIBUTING.md walks through it).
"""

from peerflow.engines.base import (
    EngineBase,
    EngineContext,
    EngineInfo,
    NoOptions,
    WeightSyncStats,
)
from peerflow.engines.rollout import (
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
    tokens_before_stop,
)
from peerflow.engines.tp_rollout import TensorParallelRolloutEngine
from peerflow.engines.train import (
    LossFunction,
    OptimSettings,
    SavedShard,
    TrainEngine,
    tensors_of,
    yield_tensors,
)

__all__ = [
    "EngineBase",
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
    "TensorParallelRolloutEngine",
    "TrainEngine",
    "WeightSyncStats",
    "tensors_of",
    "tokens_before_stop",
    "yield_tensors",
]
