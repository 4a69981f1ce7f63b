"""PeerFlow: controller-free, engine-agnostic RL post-training for language models.

`import peerflow` is light: the names below are imported on first use (PEP 562), so a
process that needs only a small piece — a reward pool worker, the CLI's `--help` — does
not pay for torch. Engines (vLLM, SGLang, DeepSpeed, Megatron-core, Ray) are imported
lazily by their adapters, when a run selects them.
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
    "GenerationRequest": "peerflow.engines",
    "GenerationResult": "peerflow.engines",
    "ParallelLayout": "peerflow.layout",
    "RolloutEngine": "peerflow.engines",
    "SamplingParams": "peerflow.engines",
    "ShardPiece": "peerflow.shard",
    "ShardSpec": "peerflow.shard",
    "TrainEngine": "peerflow.engines",
    "evaluate": "peerflow.api",
    "train": "peerflow.api",
}

if TYPE_CHECKING:
    from peerflow.api import evaluate, train
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
    "GenerationRequest",
    "GenerationResult",
    "ParallelLayout",
    "RolloutEngine",
    "SamplingParams",
    "ShardPiece",
    "ShardSpec",
    "TrainEngine",
    "__version__",
    "evaluate",
    "train",
]
