"""Where every tensor lives, decided in one place.

PeerFlow's device contract (docs/architecture.md, "Where tensors live"):

* **Host.** A `Batch`, its ids, offsets and metadata, and everything the worker,
  coordinator, streaming and the advantage estimators touch live on the CPU.
* **Device.** Engines compute on `rank_device()`: the accelerator this rank was given
  (`torch.accelerator`: CUDA, or any other backend torch knows, the emulated one of
  `peerflow.testing` included, which torch loads as a device extension: this module never
  imports it), else the CPU. The training toolkit moves a micro-batch
  onto it once and brings the results back once (`peerflow.training.engine`).
* **Process groups.** Every group carries host tensors over gloo and device tensors over
  the device's collective backend (NCCL for CUDA): `group_backend()` names both, and
  `peerflow.distributed.groups.new_group` is the one place groups are made. Ranks that
  share one device (more local ranks than devices) carry device tensors over gloo too,
  since NCCL refuses two ranks on one GPU.

Nothing else in PeerFlow asks `torch.cuda` where to compute.
"""

from __future__ import annotations

import os

import torch

#: The host: batches, metadata and collectives of host tensors.
HOST = torch.device("cpu")


def accelerator_type() -> str | None:
    """The accelerator torch can use in this process (`"cuda"`, …), or `None`."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    current = accelerator.current_accelerator()
    return None if current is None or current.type == "cpu" else current.type


def device_count() -> int:
    """How many accelerators this process sees (0 without one)."""
    return torch.accelerator.device_count() if accelerator_type() else 0


def local_rank() -> int:
    """This process's rank on its host (`$LOCAL_RANK`, 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """How many ranks run on this host (`$LOCAL_WORLD_SIZE`, 1 when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def rank_device(rank: int | None = None) -> torch.device:
    """The device this rank computes on: its accelerator, else the CPU.

    Args:
        rank: The rank on this host; defaults to `local_rank()`. With fewer devices than
            ranks, ranks take devices round-robin (several share one).
    """
    kind = accelerator_type()
    if kind is None:
        return HOST
    rank = local_rank() if rank is None else rank
    return torch.device(kind, rank % max(device_count(), 1))


def ranks_share_devices() -> bool:
    """Whether several ranks of this host compute on one device."""
    count = device_count()
    return bool(count) and local_world_size() > count


def device_backend(device: torch.device) -> str:
    """The collective backend for tensors on `device`.

    gloo on the host and when ranks share a device (NCCL refuses two ranks on one GPU);
    otherwise torch's default for the device type (`nccl` for CUDA).
    """
    import torch.distributed as dist

    if device.type == "cpu" or ranks_share_devices():
        return "gloo"
    return dist.get_default_backend_for_device(device.type)


def group_backend(device: torch.device | None = None) -> str:
    """The backend string of every process group: host over gloo, device over its own.

    `"gloo"` on a CPU-only rank, `"cpu:gloo,cuda:nccl"` on a GPU (as vLLM, verl and
    torchtitan do), `"cpu:gloo,cuda:gloo"` when ranks share a GPU.
    """
    device = rank_device() if device is None else device
    if device.type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device.type}:{device_backend(device)}"


def use_device(device: torch.device) -> None:
    """Makes `device` this process's current accelerator (no-op on the host)."""
    if device.type != "cpu" and device.index is not None:
        torch.accelerator.set_device_index(device.index)


def supports_bf16(device: torch.device) -> bool:
    """Whether `device` is an accelerator that computes in bfloat16 natively.

    The host answers `False` (bfloat16 runs there, but slower than float32); an
    accelerator answers through its torch module (`is_bf16_supported()`; CUDA: Ampere
    or newer), and one whose module cannot tell answers `False`.
    """
    if device.type == "cpu":
        return False
    check = getattr(getattr(torch, device.type, None), "is_bf16_supported", None)
    try:
        return bool(check()) if callable(check) else False
    except (RuntimeError, AssertionError):
        return False


def resolve_bf16(setting: bool | str, device: torch.device) -> bool:
    """Whether a train engine on `device` computes in bfloat16 (`trainer.bf16`).

    Args:
        setting: `auto` (bfloat16 where `supports_bf16(device)`, float32 on the CPU),
            `True` (bfloat16, float32 with a warning on an accelerator without it), or
            `False`.
        device: The engine's device (`EngineContext.device`).
    """
    if setting == "auto":
        return supports_bf16(device)
    if setting and device.type != "cpu" and not supports_bf16(device):
        import warnings

        warnings.warn(f"trainer.bf16 is on but {device} lacks bfloat16; training in float32.",
                      stacklevel=2)
        return False
    return bool(setting)
