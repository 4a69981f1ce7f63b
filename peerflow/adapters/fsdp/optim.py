"""Global-norm gradient clipping over plain tensors and DTensors.

With tensor parallelism a model mixes parameters on different meshes (2-D dp × tp
shards and 1-D dp shards of tp-replicated tensors), which torch's `clip_grad_norm_`
cannot stack into one norm. Gradients are grouped by (mesh, placements); each group's
norm is one DTensor reduction, and the groups combine as a sum of squares.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scales gradients so their global 2-norm is at most `max_norm`.

    Collective when gradients are DTensors: every rank of their meshes must call it.

    Args:
        params: Parameters whose `.grad` to clip (missing gradients are skipped).
        max_norm: Largest allowed norm; 0 or less only measures.

    Returns:
        The global norm before clipping.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    by_spec: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        by_spec.setdefault(key, []).append(g)
    squares = 0.0
    for group in by_spec.values():
        if _sharded_on_one_dim(group[0]):
            squares += _sum_of_squares_of_shards(group)
            continue
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    total = squares**0.5
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        with torch.no_grad():
            for g in grads:
                g.mul_(scale)
    return total


def _sharded_on_one_dim(grad: torch.Tensor) -> bool:
    """A DTensor sharded over a 1-D mesh (plain FSDP): each element lives on one rank."""
    from torch.distributed.tensor import DTensor

    return (isinstance(grad, DTensor) and grad.device_mesh.ndim == 1
            and all(p.is_shard() for p in grad.placements))


def _sum_of_squares_of_shards(group: list[torch.Tensor]) -> float:
    """The global sum of squares of 1-D-mesh-sharded gradients: one all-reduce.

    The same value DTensor's norm computes, without its per-op sharding dispatch: the
    local shards' norms on plain tensors, then one sum over the mesh.
    """
    local = torch.nn.utils.get_total_norm([g.to_local() for g in group], norm_type=2.0)
    squares = local.double().square().reshape(1)
    mesh = group[0].device_mesh
    if mesh.size() > 1:
        dist.all_reduce(squares, group=mesh.get_group())
    return float(squares)
