"""GPT-OSS family: biased attention with per-head sinks, packed biased experts.

Checkpoints hold every tensor under its `transformers` module name, experts packed:
`mlp.router.weight` `[E, H]` and `.bias` `[E]`; `mlp.experts.gate_up_proj` `[E, H, 2I]`
(input-major, gate and up interleaved column by column), `gate_up_proj_bias` `[E, 2I]`,
`down_proj` `[E, I, H]`, `down_proj_bias` `[E, H]`; `self_attn.sinks` `[num_heads]`. The
expert width is `intermediate_size`; every layer is sparse.

vLLM's GPT-OSS module holds `w13_weight`/`w2_weight` as the *transposes* of these
(`[E, 2I, H]`, `[E, H, I]`; its loader permutes them), which a `ShardSpec` — boxes copied
without reshaping — cannot describe: `vllm_layout` refuses the family.
"""

from __future__ import annotations

from typing import Any

from peerflow.models.config import Getter, register_family


def gpt_oss_fields(get: Getter) -> dict[str, Any]:
    """Family fields of a GPT-OSS config."""
    experts = int(get("num_local_experts", 0) or 0)
    layers = int(get("num_hidden_layers"))
    bias = bool(get("attention_bias", True))
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "num_experts": experts,
        "moe_intermediate_size": int(get("intermediate_size")),
        "sparse_layers": tuple(range(layers)) if experts else (),
        "packed_experts": True,
        "attn_sinks": True,
    }


register_family("gpt_oss", gpt_oss_fields)
