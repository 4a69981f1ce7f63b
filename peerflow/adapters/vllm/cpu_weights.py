"""Keep live linear weights on vLLM's CPU backend, so weights can be replaced in place.

After loading, vLLM-CPU hands every 2-D linear weight to a kernel that prepacks it
(`dispatch_cpu_unquantized_gemm` in `vllm.model_executor.layers.utils`): the packed copy
is what the forward pass reads, and `layer.weight` is replaced by an empty tensor. A
weight sync that writes `layer.weight` then either fails (`load_weights` into a
`torch.Size([0])` parameter) or silently changes nothing (the LM head keeps its weight
but computes from the stale packed copy).

`keep_live_weights()` swaps that dispatch for one that leaves `layer.weight` in place and
computes with `torch.nn.functional.linear` on it, so a copy into the parameter is what the
next forward pass uses. Non-2-D weights (MoE experts, convolutions) keep vLLM's own
dispatch. The swap is made in the process that loads the model — vLLM's worker — by the
PeerFlow worker extension before the model is built, and only on the CPU platform.
"""

from __future__ import annotations

from typing import Any

_PATCHED_ATTR = "_peerflow_keeps_live_weights"


def keep_live_weights() -> bool:
    """Makes vLLM-CPU keep live 2-D linear weights in this process.

    Idempotent; does nothing off the CPU platform.

    Returns:
        Whether the dispatch is (now) the weight-keeping one.
    """
    import torch
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _PATCHED_ATTR, False):
        return True

    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:
            original(layer, remove_weight)
            return
        layer.cpu_linear = _linear

    def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        return torch.nn.functional.linear(x, weight, bias)

    setattr(dispatch_keeping_weight, _PATCHED_ATTR, True)
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    return True
