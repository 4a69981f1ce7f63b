"""Mixtral family: Llama attention, every layer a mixture of experts.

Checkpoints name a layer's MoE module `block_sparse_moe`: router `block_sparse_moe.gate.weight`
`[num_local_experts, hidden]`, expert e's gate/up/down `block_sparse_moe.experts.{e}.w1/w3/w2
.weight`; the expert width is `intermediate_size`. `transformers` ≥ 5 holds the same tensors
as `mlp.gate.weight` and packed `mlp.experts.gate_up_proj` / `down_proj` (its
`conversion_mapping`), vLLM as `block_sparse_moe.gate.weight` and FusedMoE `w13`/`w2`.
"""

from __future__ import annotations

from typing import Any

from peerflow.models.config import Getter, register_family
from peerflow.models.llama import llama_fields


def mixtral_fields(get: Getter) -> dict[str, Any]:
    """Family fields of a Mixtral config."""
    experts = int(get("num_local_experts", 0) or 0)
    layers = int(get("num_hidden_layers"))
    return {
        **llama_fields(get),
        "num_experts": experts,
        "moe_intermediate_size": int(get("intermediate_size")),
        "sparse_layers": tuple(range(layers)) if experts else (),
        "moe_block": "block_sparse_moe",
        "expert_names": ("w1", "w3", "w2"),
    }


register_family("mixtral", mixtral_fields)
