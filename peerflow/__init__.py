"""PeerFlow: controller-free, engine-agnostic RL post-training for language models.

`import peerflow` loads the engine-agnostic core only; engines (vLLM, SGLang, DeepSpeed,
Megatron-core, Ray) are imported lazily by their adapters, when a run selects them.
"""

from __future__ import annotations

from peerflow.batch import Batch
from peerflow.capabilities import Capabilities
from peerflow.engines import (
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
    TrainEngine,
)
from peerflow.layout import ParallelLayout
from peerflow.shard import Box, ShardPiece, ShardSpec

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Box",
    "Capabilities",
    "GenerationRequest",
    "GenerationResult",
    "ParallelLayout",
    "RolloutEngine",
    "SamplingParams",
    "ShardPiece",
    "ShardSpec",
    "TrainEngine",
    "__version__",
]
