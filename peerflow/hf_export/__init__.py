"""Hugging Face model directories out of runs: `peerflow export` and its pieces.

* `export` — a run's checkpoint (newest verified, or a step) as a model directory.
* `checkpoint_tensors`, `choose_checkpoint` — the steps of `export`, for callers that
  compose their own (e.g. adapter-only or merged LoRA exports).
* `assemble_hf_tensors` — whole HF tensors from a train adapter's `SavedShard`s.
* `write_model_dir`, `unique_tensors` — the one HF directory writer (`export`, `sft`).
"""

from peerflow.hf_export.assemble import assemble_hf_tensors
from peerflow.hf_export.hf_dir import DEFAULT_SHARD_SIZE, unique_tensors, write_model_dir
from peerflow.hf_export.run import DTYPES, Exported, checkpoint_tensors, choose_checkpoint, export

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "DTYPES",
    "Exported",
    "assemble_hf_tensors",
    "checkpoint_tensors",
    "choose_checkpoint",
    "export",
    "unique_tensors",
    "write_model_dir",
]
