"""Qwen3-MoE family: Qwen3 attention plus mixture-of-experts MLPs.

A layer is sparse when it is not in `mlp_only_layers` and `(layer + 1) %
decoder_sparse_step == 0` (the rule of `transformers`' `Qwen3MoeDecoderLayer`). Its
router is `mlp.gate.weight` `[num_experts, hidden]`; in canonical (checkpoint) form each
expert is `mlp.experts.{e}.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

from typing import Any

from peerflow.models.config import Getter, register_family
from peerflow.models.qwen3 import qwen3_fields


def qwen3_moe_fields(get: Getter) -> dict[str, Any]:
    """Family fields of a Qwen3-MoE config."""
    experts = int(get("num_experts", 0) or 0)
    step = int(get("decoder_sparse_step", 1) or 1)
    dense_only = set(get("mlp_only_layers", ()) or ())
    layers = int(get("num_hidden_layers"))
    sparse = tuple(
        i for i in range(layers) if experts > 0 and i not in dense_only and (i + 1) % step == 0
    )
    return {
        **qwen3_fields(get),
        "num_experts": experts,
        "moe_intermediate_size": int(get("moe_intermediate_size", 0) or 0),
        "sparse_layers": sparse,
    }


register_family("qwen3_moe", qwen3_moe_fields)
