"""PeerFlow: controller-free, engine-agnostic RL post-training for language models.

`import peerflow` is light: the names below are imported on first use (PEP 562), so a
process that needs only a small piece — a reward pool worker, the CLI's `--help` — does
not pay for torch. Engines (vLLM, SGLang, DeepSpeed, Megatron-core, Ray) are imported
lazily by their adapters, when a run selects them.

What an engine author needs is exported here: the contracts (`RolloutEngine`,
`TrainEngine`, `EngineContext`, `Capabilities`, the sampling types), the shard
description (`ShardSpec`, `ShardPiece`, `Box`) and the layout builders that produce
`ShardSpec` lists for the supported model families (`hf_layout`, `tp_layout`,
`vllm_layout`, `sglang_layout`, `megatron_layout`, `hf_parameters`, `ModelShape`) at a
rank's `RankCoords`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> module that defines it.
_EXPORTS = {
    "Batch": "peerflow.batch",
    "Box": "peerflow.shard",
    "Capabilities": "peerflow.capabilities",
    "EngineContext": "peerflow.engines",
    "GenerationRequest": "peerflow.engines",
    "GenerationResult": "peerflow.engines",
    "ModelShape": "peerflow.models",
    "OptimSettings": "peerflow.engines",
    "ParallelLayout": "peerflow.layout",
    "RankCoords": "peerflow.models",
    "RolloutEngine": "peerflow.engines",
    "SamplingParams": "peerflow.engines",
    "ShardPiece": "peerflow.shard",
    "ShardSpec": "peerflow.shard",
    "TrainEngine": "peerflow.engines",
    "evaluate": "peerflow.api",
    "export": "peerflow.api",
    "hf_layout": "peerflow.models",
    "hf_parameters": "peerflow.models",
    "megatron_layout": "peerflow.models",
    "sglang_layout": "peerflow.models",
    "tp_layout": "peerflow.models",
    "train": "peerflow.api",
    "vllm_layout": "peerflow.models",
}

if TYPE_CHECKING:
    from peerflow.api import evaluate, export, train
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
        RankCoords,
        hf_layout,
        hf_parameters,
        megatron_layout,
        sglang_layout,
        tp_layout,
        vllm_layout,
    )
    from peerflow.shard import Box, ShardPiece, ShardSpec


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'peerflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
    "RankCoords",
    "RolloutEngine",
    "SamplingParams",
    "ShardPiece",
    "ShardSpec",
    "TrainEngine",
    "__version__",
    "evaluate",
    "export",
    "hf_layout",
    "hf_parameters",
    "megatron_layout",
    "sglang_layout",
    "tp_layout",
    "train",
    "vllm_layout",
]
