"""Qwen2 family: q/k/v projections always carry biases, the output projection never does."""

from __future__ import annotations

from typing import Any

from peerflow.models.config import Getter, register_family


def qwen2_fields(get: Getter) -> dict[str, Any]:
    """Family fields of a Qwen2 config."""
    return {"qkv_bias": True, "o_bias": False}


register_family("qwen2", qwen2_fields)
