"""Keep live linear weights on vLLM's CPU backend beside its prepacked kernels.

After loading, vLLM-CPU hands every 2-D linear weight to a kernel it chooses for the
machine (`dispatch_cpu_unquantized_gemm` in `vllm.model_executor.layers.utils`: oneDNN,
the AMX sgl kernel, zentorch): the kernel prepacks its own copy of the weight, which is
what the forward pass reads, and `layer.weight` is replaced by an empty tensor. A weight
sync could then neither write `layer.weight` (`load_weights` into a `torch.Size([0])`
parameter) nor have a write take effect (the LM head keeps its weight but computes from
the stale packed copy).

`keep_live_weights()` wraps that dispatch so it runs unchanged — same kernel choice,
same prepacking — except that `layer.weight` stays: a sync copies into the live weight,
and the worker extension then re-runs vLLM's own post-load step
(`quant_method.process_weights_after_loading`, i.e. this dispatch) so the kernels are
packed again from the new weights. The cost is memory: each linear weight is held twice
(live and packed). Installed in the process that loads the model — vLLM's worker — by
the PeerFlow worker extension before the model is built, and only on the CPU platform;
an engine started with `PEERFLOW_VLLM_KEEP_CPU_WEIGHTS=0` gets vLLM's behaviour.
"""

from __future__ import annotations

import os
from typing import Any

#: Environment switch the engine sets before vLLM starts (inherited by worker processes).
KEEP_CPU_WEIGHTS_ENV = "PEERFLOW_VLLM_KEEP_CPU_WEIGHTS"
_PATCHED_ATTR = "_peerflow_keeps_live_weights"


def keep_live_weights() -> bool:
    """Makes vLLM-CPU keep live 2-D linear weights in this process (idempotent).

    Read at each dispatch, `PEERFLOW_VLLM_KEEP_CPU_WEIGHTS=0` restores vLLM's own
    behaviour for engines built while it is set (`peerflow bench rollout`'s raw vLLM).

    Returns:
        Whether the dispatch is (now) the weight-keeping one; `False` off the CPU platform.
    """
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _PATCHED_ATTR, False):
        return True

    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        keep = os.environ.get(KEEP_CPU_WEIGHTS_ENV, "1") != "0"
        original(layer, remove_weight=remove_weight and not keep)

    setattr(dispatch_keeping_weight, _PATCHED_ATTR, True)
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    return True
