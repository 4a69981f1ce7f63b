"""Qwen3 family: per-head q/k RMSNorm (`self_attn.q_norm`, `k_norm`), optional biases."""

from __future__ import annotations

from typing import Any

from peerflow.models.config import Getter, register_family


def qwen3_fields(get: Getter) -> dict[str, Any]:
    """Family fields of a dense Qwen3 config."""
    bias = bool(get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


register_family("qwen3", qwen3_fields)
