"""Hugging Face model directories out of runs: `peerflow export` and its pieces.

* `export` — a run's checkpoint (newest verified, or a step) as a model directory.
* `checkpoint_tensors`, `choose_checkpoint` — the steps of `export`, for callers that
  compose their own (e.g. adapter-only or merged LoRA exports).
* `assemble_hf_tensors` — whole HF tensors from a train adapter's `SavedShard`s.
* `write_model_dir`, `unique_tensors` — the one HF directory writer (`export`, `sft`).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name → submodule that defines it; imported on first use, so building the
#: command line (`peerflow export --help`) does not import torch.
_EXPORTS = {
    "assemble_hf_tensors": "assemble",
    "DEFAULT_SHARD_SIZE": "hf_dir",
    "unique_tensors": "hf_dir",
    "write_model_dir": "hf_dir",
    "DTYPES": "run",
    "Exported": "run",
    "checkpoint_tensors": "run",
    "choose_checkpoint": "run",
    "export": "run",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
