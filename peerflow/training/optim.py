"""The optimiser every train engine steps with when its framework has none of its own."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from peerflow.engines.train import OptimSettings


def build_adamw(params: Iterable[torch.nn.Parameter], optim: OptimSettings, *,
                foreach: bool | None = None, fused: bool | None = None) -> torch.optim.AdamW:
    """`torch.optim.AdamW` over the trainable `params` with the run's settings.

    Args:
        params: Parameters (plain tensors or DTensors); frozen ones are left out.
        optim: Learning rate, betas, eps, weight decay.
        foreach: torch's multi-tensor update; `None` lets torch choose. It groups tensors
            across DTensor meshes, so parameters on several meshes need `False`.
        fused: torch's fused update (one kernel for every parameter; the same AdamW
            formula, rounding may differ from the multi-tensor one in the last bit).
    """
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad], lr=optim.lr, betas=optim.betas,
        eps=optim.eps, weight_decay=optim.weight_decay, foreach=foreach,
        fused=fused,
    )
