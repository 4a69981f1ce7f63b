"""Checkpoints of the DeepSpeed engine: DeepSpeed's own files plus PeerFlow's metadata.

Every rank writes its ZeRO partition files under `directory/<checkpoint_tag>/` with
DeepSpeed's `save_checkpoint`; dp-rank 0 writes `peerflow_deepspeed.json` (atomically):
the weight version, ZeRO stage, dp size, tag, and the full shape of every parameter.
Loading is strict: the recorded shapes must be exactly the model's
(`peerflow.checkpoint.check_shapes`) before DeepSpeed reads anything, and the dp size must
be the one the checkpoint was written with.
"""

from __future__ import annotations

import json
import os
from typing import Any

from peerflow.checkpoint import check_shapes, write_json_atomic
from peerflow.errors import ConfigError

META = "peerflow_deepspeed.json"


def _shapes(engine: Any) -> dict[str, list[int]]:
    return {n: list(engine._full_shape(p)) for n, p in engine._module.named_parameters()}


def save(engine: Any, directory: str) -> None:
    """Writes `engine`'s model, optimiser and metadata into `directory` (every rank)."""
    import torch.distributed as dist

    os.makedirs(directory, exist_ok=True)
    tag = engine.options.checkpoint_tag
    engine.engine.save_checkpoint(directory, tag=tag,
                                  client_state={"peerflow_version": engine.version})
    if engine.dp_rank == 0:
        write_json_atomic(os.path.join(directory, META), {
            "version": engine.version, "zero_stage": engine.zero_stage,
            "dp_size": engine.dp_size, "tag": tag, "shapes": _shapes(engine),
        })
    dist.barrier(group=engine.dp_group)


def load(engine: Any, directory: str) -> None:
    """Restores what `save` wrote (same dp size; exactly the same parameter shapes)."""
    meta_path = os.path.join(directory, META)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(
            f"{directory} holds no DeepSpeed checkpoint written by PeerFlow "
            f"({meta_path} is missing); pass the directory save_checkpoint wrote."
        )
    with open(meta_path) as handle:
        meta: dict[str, Any] = json.load(handle)
    if meta["dp_size"] != engine.dp_size:
        raise ConfigError(
            f"checkpoint {directory} was written by {meta['dp_size']} DeepSpeed ranks but "
            f"this run has {engine.dp_size}; resume with the same trainer layout."
        )
    check_shapes(meta.get("shapes", {}), _shapes(engine), where=directory)
    path, client = engine.engine.load_checkpoint(directory, tag=meta["tag"])
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}.")
    engine.version = int(client.get("peerflow_version", meta["version"]))
