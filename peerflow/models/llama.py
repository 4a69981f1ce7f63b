"""Llama family (also Mistral-style configs): optional `attention_bias` and `mlp_bias`."""

from __future__ import annotations

from typing import Any

from peerflow.models.config import Getter, register_family


def llama_fields(get: Getter) -> dict[str, Any]:
    """Family fields of a Llama config: `attention_bias` covers q/k/v and o."""
    bias = bool(get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(get("mlp_bias", False))}


register_family("llama", llama_fields)
register_family("mistral", llama_fields)
