"""Building and probing real engines for layer 3 (and layer 4 on GPU)."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import pytest
import torch

from peerflow.conformance.profile import AdapterProfile
from peerflow.engines import EngineContext, OptimSettings
from peerflow.layout import ParallelLayout


def world_group() -> Any:
    """Returns the default process group, starting a one-process group if needed.

    The group has the device contract's backends (`peerflow.distributed.devices`): gloo
    for host tensors, the accelerator's backend for device tensors.
    """
    import torch.distributed as dist

    from peerflow.distributed.devices import group_backend, rank_device

    if not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = os.path.join(tempfile.mkdtemp(prefix="peerflow-conformance-"), "store")
        dist.init_process_group(group_backend(rank_device()), init_method=f"file://{store}",
                                rank=0, world_size=1)
    return dist.group.WORLD


def rank_group(rank: int, world: int, store: str) -> Any:
    """Joins `rank` to a `world`-rank default group over the file `store` (spawned ranks).

    The contract's backends, as `world_group` (gloo on the host, the accelerator's
    backend for device tensors).
    """
    import datetime

    import torch.distributed as dist

    from peerflow.distributed.devices import group_backend, rank_device

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(group_backend(rank_device()), init_method=f"file://{store}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    return dist.group.WORLD


def build_engine(profile: AdapterProfile, model_dir: str, *, device: str | None = None,
                 lora: Any = None) -> Any:
    """Builds a one-rank engine of `profile` on `model_dir` (the adapter's hook wins).

    Args:
        profile: The adapter under test.
        model_dir: The tiny checkpoint.
        device: Where the engine computes; this rank's accelerator when there is one
            (`peerflow.distributed.devices.rank_device`), else the CPU.
        lora: `trainer.lora` settings (`EngineContext.lora`) for the LoRA layer; the
            adapter's `conformance_engine` hook builds engines without adapters only.
    """
    from peerflow.distributed.devices import rank_device

    device = str(rank_device()) if device is None else device
    hook = profile.hook("conformance_engine")
    if hook is not None and lora is None:
        return hook(model_dir, device=device)
    group = world_group()
    context = EngineContext(model_path=model_dir, layout=ParallelLayout(), rank=0,
                            dtype="float32", device=device, process_group=group, lora=lora)
    options = profile.cls.options_class()
    if profile.kind == "train":  # float32 compute, padded: the reference's arithmetic
        return profile.cls(context, options, OptimSettings(bf16=False, padding_free=False))
    return profile.cls(context, options)


def read_weights(profile: AdapterProfile, engine: Any) -> dict[str, torch.Tensor]:
    """The engine's own tensors through the adapter's bypass hook (skips without one)."""
    hook = profile.hook("conformance_read_weights")
    if hook is None:
        pytest.skip(f"{profile.name} defines no conformance_read_weights(engine) classmethod; "
                    "layer 3 needs a read path that bypasses the adapter")
    return {name: t.detach() for name, t in hook(engine).items()}


def scribble(profile: AdapterProfile, engine: Any) -> None:
    """Overwrites every engine weight with a constant (the adapter's hook wins)."""
    hook = profile.hook("conformance_scribble")
    if hook is not None:
        hook(engine)
        return
    with torch.no_grad():
        for tensor in read_weights(profile, engine).values():
            tensor.fill_(-7.0)


def as_declared(tensors: dict[str, torch.Tensor], specs: list) -> dict[str, torch.Tensor]:
    """`tensors` viewed as their specs declare them (packed MoE experts: the 2-D view)."""
    shapes = {s.local_name: tuple(s.local_shape) for s in specs}
    out = {}
    for name, tensor in tensors.items():
        shape = shapes.get(name)
        if shape is not None and tuple(tensor.shape) != shape and \
                tensor.numel() == math.prod(shape):
            tensor = tensor.reshape(shape)
        out[name] = tensor
    return out
