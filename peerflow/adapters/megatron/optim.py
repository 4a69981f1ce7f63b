"""Optimisers of the Megatron engine: Megatron's distributed optimizer (GPU) or AdamW.

On CPU, megatron-core 0.16's optimizers refuse non-CUDA tensors, so a `torch.optim.AdamW`
steps the parameters with the gradients Megatron's DDP wrapper reduced into
`param.main_grad`. Clipping then needs the global norm over the model-parallel group,
counting each tensor once: tp-replicated tensors (norms) only on tp rank 0, and the last
stage's copy of a tied embedding (`shared`) not at all. With expert parallelism the norm
is summed over tp × pp × ep: each ep rank's own experts (`allreduce=False` in Megatron)
count everywhere, the tensors every ep rank holds alike only on ep rank 0.
"""

from __future__ import annotations

from typing import Any

import torch

from peerflow.engines import OptimSettings
from peerflow.training import build_adamw, build_lr_scheduler, torch_dtype


def build_optimizer(model: Any, module: torch.nn.Module, optim: OptimSettings, *,
                    dtype: torch.dtype, distributed: bool) -> Any:
    """Returns Megatron's distributed optimizer over `model` (DDP-wrapped) or AdamW.

    Args:
        model: The DDP-wrapped `GPTModel`.
        module: The bare `GPTModel` (its parameters).
        optim: PeerFlow's optimiser settings.
        dtype: Parameter dtype (bf16 turns on Megatron's mixed precision).
        distributed: Use Megatron's distributed optimizer (CUDA only).
    """
    if distributed:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
            clip_grad=optim.grad_clip, use_distributed_optimizer=True,
            bf16=dtype == torch.bfloat16,
        )
        return get_megatron_optimizer(config, [model])
    return build_adamw(module.parameters(), optim)


def param_dtype(bf16: bool, setting: bool | str, options: Any, dtype: str) -> torch.dtype:
    """The dtype Megatron builds its parameters in.

    Megatron's bfloat16 means bfloat16 parameters, whose float32 main copies only its
    distributed optimizer keeps: `trainer.bf16: auto` takes them there alone (AdamW on
    bfloat16 weights loses small updates), `true` forces them.

    Args:
        bf16: `trainer.bf16` resolved for the device (`resolve_bf16`).
        setting: `trainer.bf16` as configured (`auto`, `True`, `False`).
        options: The engine's `MegatronOptions`.
        dtype: `model.dtype`, used otherwise.
    """
    if bf16 and (setting is True or options.use_distributed_optimizer):
        return torch.bfloat16
    return torch_dtype(dtype)


def build_lr_schedulers(optimizer: Any, optim: OptimSettings) -> list[Any]:
    """The run's learning-rate schedule over every torch optimiser inside `optimizer`.

    AdamW has one; Megatron's (chained) distributed optimizer steps one torch optimiser per
    parameter kind, whose param groups the schedule moves (`peerflow.training.schedule`).
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return [build_lr_scheduler(optimizer, optim)]
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [build_lr_scheduler(part.optimizer, optim) for part in parts]


def clip_and_step(optimizer: Any, module: torch.nn.Module, grad_clip: float, *,
                  tp_rank: int, group: Any, ep_rank: int = 0) -> float:
    """Clips and applies the reduced gradients; returns the pre-clip global norm.

    Args:
        optimizer: What `build_optimizer` returned.
        module: The bare `GPTModel`.
        grad_clip: Global norm limit (0 disables clipping).
        tp_rank: This rank's tensor-parallel index.
        group: The group the norm is summed over (tp × pp, × ep with experts split).
        ep_rank: This rank's expert-parallel index.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        _, norm, _ = optimizer.step()  # Megatron clips inside its own step
        return float(norm or 0.0)
    import torch.distributed as dist

    params = list(module.parameters())
    square = torch.zeros((), dtype=torch.float64, device=params[0].device)  # with the grads
    for param in params:
        param.grad = param.main_grad.to(param.dtype)
        counted = getattr(param, "tensor_model_parallel", False) or tp_rank == 0
        counted = counted and (ep_rank == 0 or not getattr(param, "allreduce", True))
        if counted and not getattr(param, "shared", False):
            square += param.grad.double().pow(2).sum()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(square, group=group)
    norm = float(square.sqrt())
    if grad_clip > 0 and norm > grad_clip:
        scale = grad_clip / (norm + 1e-6)
        for param in params:
            param.grad.mul_(scale)
    optimizer.step()
    return norm
