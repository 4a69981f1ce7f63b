"""Megatron's process groups for an engine layout (tp, pp and ep; dp fills the world).

PeerFlow's layout has ep peers of one dp replica consume the same samples (as tp peers
do); Megatron carves expert parallelism out of its data-parallel ranks. So with `ep > 1`
Megatron's dense data-parallel group holds ep peers that computed the same gradients
(the engine scales its loss by `1 / ep`, which makes their sum the gradient of the
samples), and PeerFlow's dp group is Megatron's *expert* data-parallel group (same ep,
tp and pp coordinate, distinct samples): `dp_group_and_rank`.
"""

from __future__ import annotations

import os
from typing import Any

from peerflow.adapters.megatron.cpu import enable_redirects, needs_redirects
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError


def ensure_distributed(context: EngineContext) -> None:
    """Starts torch.distributed for a standalone engine, with the contract's backends."""
    import torch.distributed as dist

    from peerflow.distributed.devices import group_backend

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
    dist.init_process_group(group_backend(context.device),
                            rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))


def _import_megatron() -> None:
    """Imports the Megatron modules the engine calls (so the CPU redirect covers them)."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401


def init_parallel_state(context: EngineContext) -> Any:
    """Megatron's parallel state for `context.layout` (redirects first, off CUDA).

    Returns:
        `megatron.core.parallel_state`, initialised and seeded.

    Raises:
        ConfigError: This process already runs Megatron with another tp/pp.
    """
    layout = context.layout
    _import_megatron()
    if needs_redirects(context.device):
        enable_redirects(context.device)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        current = (ps.get_tensor_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_world_size(),
                   ps.get_expert_model_parallel_world_size())
        if current != (layout.tp, layout.pp, layout.ep):
            raise ConfigError(
                f"Megatron's parallel state is already initialised with another tp/pp/ep than "
                f"{layout.describe()}; one process hosts one Megatron layout."
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                     pipeline_model_parallel_size=layout.pp,
                                     expert_model_parallel_size=layout.ep)
    model_parallel_cuda_manual_seed(context.seed)
    return ps


def dp_group_and_rank(ps: Any) -> tuple[Any, int]:
    """The group of ranks with distinct samples (PeerFlow's dp) and this rank's index in it.

    Megatron's expert data-parallel group: with `ep == 1` its data-parallel group.
    """
    return ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_rank()


def clip_group(ps: Any, ep: int) -> Any:
    """The group a gradient norm is summed over: tp × pp, and ep with expert parallelism."""
    if ep > 1:
        return ps.get_expert_tensor_model_pipeline_parallel_group()
    return ps.get_model_parallel_group()
