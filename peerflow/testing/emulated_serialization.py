"""`torch.load` on the emulated accelerator: `map_location` may name the device.

A checkpoint is loaded onto a GPU with `torch.load(f, map_location=torch.device("cuda", 0))`
(the usual way to restore optimizer state). torch moves each *storage* there
(`UntypedStorage.to`), which the emulated device cannot take: its tensors are wrapper
subclasses over CPU tensors, with no storage of their own, and the storage copy crashed
the process (exit 139). `load` loads onto the CPU instead and moves each tensor with
`Tensor.to`, as the device's tensors are made everywhere else; `map_location="cpu"` brings
tensors saved on the device back to the host, as CUDA's do. A `map_location` dict or
callable that names the device is refused with the fix; one that does not passes through.
Tensors saved on the device load with `weights_only=True` too (their rebuild function is
allow-listed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from peerflow.testing.emulated_tensor import DEVICE_TYPE, EmulatedTensor, rebuild


def _named_device(map_location: Any) -> torch.device | None:
    """The device a plain `map_location` (a string or a device) names, else `None`."""
    if isinstance(map_location, str | torch.device):
        return torch.device(map_location)
    return None


def _names_the_device(map_location: Any) -> bool:
    """Whether a dict `map_location` maps some location onto the emulated device."""
    return isinstance(map_location, dict) and any(
        str(target).startswith(DEVICE_TYPE) for target in map_location.values())


def _load_patch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if _names_the_device(map_location):
            raise RuntimeError(
                f"torch.load(map_location={map_location!r}): the emulated accelerator takes a "
                f"map_location that names one device (torch.device('{DEVICE_TYPE}', 0) or "
                f"'{DEVICE_TYPE}:0'), or 'cpu' and then .to(device); a dict naming it cannot "
                "be honoured (peerflow.testing.emulated_serialization).")
        device = _named_device(map_location)
        if device is None:
            return original(f, map_location, *args, **kwargs)
        loaded = original(f, "cpu", *args, **kwargs)
        if device.type == "cpu":
            return tree_map_only(EmulatedTensor, lambda t: t.cpu(), loaded)
        return tree_map_only(torch.Tensor, lambda t: t.to(map_location), loaded)

    return load


def patch_load() -> None:
    """Installs `load` as `torch.load`, and allow-lists the device's tensors for it."""
    torch.serialization.add_safe_globals([rebuild])
    torch.load = _load_patch(torch.load)
