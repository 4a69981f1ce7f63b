"""Canonical specs of `transformers` ≥ 5 packed expert tensors, whole or FSDP-sharded.

A `transformers` MoE module holds a layer's experts packed: `mlp.experts.gate_up_proj`
`[E, 2I, H]` (expert e's gate rows, then its up rows) and `mlp.experts.down_proj`
`[E, H, I]`. Engines that describe their parameters by module name (the hf rollout
engine, the fsdp trainer) would otherwise send these under their module names, which only
another `transformers` module understands. `canonical_expert_spec` turns such a spec —
the whole tensor, or an FSDP2 dim-0 shard (a block of experts) — into the spec of its
2-D view (`[E*2I, H]`, `[E*H, I]`) whose pieces are the canonical HF tensors, experts
one by one (`model.layers.{L}.mlp.experts.{e}.gate_proj.weight`, …): what vLLM's fused
`w13`/`w2` and Megatron's experts are planned against (Mixtral's: `block_sparse_moe.
experts.{e}.w1/w3/w2.weight`, and its router `mlp.gate.weight` is renamed to the
checkpoint's `block_sparse_moe.gate.weight`). `as_declared` views a live tensor as its spec
says. GPT-OSS checkpoints hold the modules' own packed tensors: nothing to convert.
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs
import torch

from peerflow.errors import ConfigError
from peerflow.models.common import restrict_rows
from peerflow.models.config import ModelShape
from peerflow.models.hf import packed_expert_specs
from peerflow.shard import ShardSpec

_PACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")


def canonical_expert_spec(config: Any, spec: ShardSpec) -> ShardSpec | None:
    """The canonical spec of a module-named packed-expert spec, or `None` if it is not one.

    Args:
        config: The model's HF config (object or dict) or `ModelShape`.
        spec: A spec named as the module's parameter, over the 3-D tensor (whole, or a
            dim-0 block of experts as FSDP2 shards it).

    Returns:
        The spec of the local tensor's 2-D view, same local name and replica (a Mixtral
        router: the same spec, its pieces named as the checkpoint does); `None` for any
        other tensor, or a family whose checkpoints use the module names.
    """
    match = _PACKED.match(spec.local_name)
    router = _ROUTER.match(spec.local_name)
    if (match is None or len(spec.local_shape) != 3) and router is None:
        return None
    try:
        shape = ModelShape.from_hf_config(config)
    except ConfigError:
        return None
    layer = int((match or router).group(1))
    if not shape.is_sparse(layer) or shape.packed_experts:
        return None
    if router is not None:  # Mixtral: the module's `mlp.gate` is `block_sparse_moe.gate`
        if shape.router_name(layer) == spec.local_name:
            return None
        return attrs.evolve(spec, pieces=tuple(attrs.evolve(p, name=shape.router_name(layer))
                                               for p in spec.pieces))
    full, unit = packed_expert_specs(shape, layer, spec.dtype)[
        0 if match.group(2) == "gate_up_proj" else 1]
    first = spec.pieces[0].global_box.offsets[0] if spec.pieces else 0
    rows = range(first * unit, (first + spec.local_shape[0]) * unit)
    return attrs.evolve(restrict_rows(full, rows, local_name=spec.local_name),
                        replica=spec.replica)


def canonical_specs(config: Any, specs: list[ShardSpec]) -> list[ShardSpec]:
    """`specs` with every packed-expert spec made canonical (`canonical_expert_spec`)."""
    return [canonical_expert_spec(config, spec) or spec for spec in specs]


def as_declared(tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """`tensor` viewed as `spec.local_shape` (a packed expert tensor's 2-D view).

    Raises:
        ValueError: the element counts differ (the spec is not of this tensor).
    """
    if tuple(tensor.shape) == tuple(spec.local_shape):
        return tensor
    if tensor.numel() != math.prod(spec.local_shape):
        raise ValueError(f"{spec.local_name}: tensor of shape {tuple(tensor.shape)} cannot be "
                         f"viewed as the spec's {spec.local_shape}.")
    return tensor.view(spec.local_shape)
