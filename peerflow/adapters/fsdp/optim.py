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
