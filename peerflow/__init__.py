"""PeerFlow: controller-free, engine-agnostic RL post-training for language models.

`import peerflow` loads the engine-agnostic core only; engines (vLLM, SGLang, DeepSpeed,
Megatron-core, Ray) are imported lazily by their adapters, when a run selects them.

What an engine author needs is exported here: the contracts (`RolloutEngine`,
`TrainEngine`, `EngineContext`, `Capabilities`, the sampling types), the shard
description (`ShardSpec`, `ShardPiece`, `Box`) and the layout builders that produce
`ShardSpec` lists for the supported model families (`hf_layout`, `tp_layout`,
`vllm_layout`, `sglang_layout`, `megatron_layout`, `hf_parameters`, `ModelShape`).
"""

from __future__ import annotations

from peerflow.batch import Batch
from peerflow.capabilities import Capabilities
from peerflow.engines import (
    EngineContext,
    GenerationRequest,
    GenerationResult,
    OptimSettings,
    RolloutEngine,
    SamplingParams,
    TrainEngine,
)
from peerflow.layout import ParallelLayout
from peerflow.models import (
    ModelShape,
    hf_layout,
    hf_parameters,
    megatron_layout,
    sglang_layout,
    tp_layout,
    vllm_layout,
)
from peerflow.shard import Box, ShardPiece, ShardSpec

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Box",
    "Capabilities",
    "EngineContext",
    "GenerationRequest",
    "GenerationResult",
    "ModelShape",
    "OptimSettings",
    "ParallelLayout",
    "RolloutEngine",
    "SamplingParams",
    "ShardPiece",
    "ShardSpec",
    "TrainEngine",
    "__version__",
    "hf_layout",
    "hf_parameters",
    "megatron_layout",
    "sglang_layout",
    "tp_layout",
    "vllm_layout",
]
