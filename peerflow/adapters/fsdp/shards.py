"""Describing FSDP2 / DTensor local shards as `ShardSpec`s of Hugging Face tensors.

Parameter names are the model's own (FSDP2 and `parallelize_module` do not rename), which
for a transformers causal LM are the HF checkpoint names. A DTensor's local tensor is one
box of the global tensor (torch's `compute_local_shape_and_global_offset`, which also
handles FSDP's strided sharding of tensor-parallel shards). Ranks that hold the same box
(tp peers of a replicated norm, say) are replicas; only replica 0 sends during a sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from peerflow.shard import Box, ShardSpec


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's plain local part of a DTensor (a plain tensor is its own)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_box(tensor: torch.Tensor) -> tuple[Box, torch.Tensor]:
    """Returns the box of the global tensor that this rank's local part covers.

    Args:
        tensor: A plain tensor (the whole tensor) or a DTensor.

    Returns:
        `(box, local)` where `local` is the rank's plain local tensor.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return Box.full(tuple(tensor.shape)), tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(
            f"DTensor local shape {tuple(local.shape)} differs from the computed shard "
            f"{tuple(shape)} (placements {tensor.placements}); this sharding is not supported."
        )
    return Box(offsets=offset, sizes=shape), local


def replica_index(tensor: torch.Tensor, coords: Mapping[str, int], sizes: Mapping[str, int]) -> int:
    """Index of this rank among the ranks that hold the same box of `tensor`.

    Args:
        tensor: A parameter (plain or DTensor).
        coords: This rank's coordinate along every mesh dimension of the engine group.
        sizes: Size of every mesh dimension of the engine group.

    Returns:
        0 on exactly one rank of every set of ranks holding identical data.
    """
    from torch.distributed.tensor import DTensor, Replicate

    sharded: set[str] = set()
    if isinstance(tensor, DTensor):
        names = tensor.device_mesh.mesh_dim_names or ()
        sharded = {n for n, p in zip(names, tensor.placements, strict=True)
                   if not isinstance(p, Replicate)}
    index = 0
    for dim, size in sizes.items():
        if dim not in sharded:
            index = index * size + coords[dim]
    return index


def named_shard_specs(
    params: Iterable[tuple[str, torch.Tensor]],
    coords: Mapping[str, int],
    sizes: Mapping[str, int],
) -> tuple[list[ShardSpec], dict[str, torch.Tensor]]:
    """Specs and plain local tensors of every parameter on this rank.

    Args:
        params: `(hf_name, parameter)` pairs; tied parameters listed once.
        coords: This rank's mesh coordinates (see `replica_index`).
        sizes: The mesh sizes.

    Returns:
        `(specs, locals)`: one spec per parameter (an empty FSDP shard has no pieces),
        and the local tensor of each spec keyed by `local_name`.
    """
    specs: list[ShardSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, param in params:
        box, local = local_box(param)
        replica = replica_index(param, coords, sizes)
        if box.numel == 0:
            spec = ShardSpec(local_name=name, local_shape=box.sizes, pieces=(),
                             dtype=_dtype_name(local.dtype), replica=replica)
        else:
            spec = ShardSpec.of_slice(name, tuple(param.shape), box,
                                      dtype=_dtype_name(local.dtype), replica=replica)
        specs.append(spec)
        tensors[name] = local
    return specs, tensors


def spec_to_json(spec: ShardSpec) -> dict[str, Any]:
    """The JSON form of a single-piece spec (name, global shape, box) for checkpoints."""
    piece = spec.pieces[0]
    return {
        "global_shape": list(piece.global_shape),
        "offsets": list(piece.global_box.offsets),
        "sizes": list(piece.global_box.sizes),
        "dtype": spec.dtype,
    }
