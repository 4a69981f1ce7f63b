"""Device indices of the emulated accelerator: how many devices, and the current one.

A process under the emulation sees `device_count()` devices, `emu:0` … `emu:<n-1>`: one
per local rank (`$LOCAL_WORLD_SIZE`, at least 1), as on a node with one GPU per rank, or
`$PEERFLOW_EMULATED_DEVICES` when set; both are read once, at `install()`. An index is a
name only: every device's values live in this process's CPU memory. The current index is
the process's (CUDA's is per thread), 0 until `set_device_index` changes it.

torch's C++ side of a backend registered from Python knows one device: its device guard
always reports index 0 as current and a count of 1. So the indices are kept here, and
answered to `torch.accelerator`, `torch.emu` and DeepSpeed (`emulated_runtime`,
`emulated_deepspeed`); a new tensor takes its inputs' index, or the one its `device=`
names, or the current one (`emulated_tensor`). With more than one device, `patch_torch()`
also covers the two places where C++ would pick index 0 itself:

* **A device named without an index** (`"emu"`): factories (`torch.ones(…, device="emu")`)
  reach the emulated kernels without an index and take the current one there, but
  `Tensor.to`, `torch.tensor`, `torch.as_tensor`, `torch.asarray` and `Tensor.new_tensor`
  fill in index 0 before that, so they are wrapped to name the current device instead
  (and the lists torch keeps of them by identity are given the wrappers or built first).
* **Backward passes**: autograd starts a worker thread for each device its device guard
  counts (device 0 only) and refuses a graph on another index, so every backward pass runs
  on its caller's thread (`torch.autograd.set_multithreading_enabled(False)`), as a CPU
  one does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

#: The device type of the emulated accelerator.
DEVICE_TYPE = "emu"
#: Overrides how many devices the emulation has (default: `$LOCAL_WORLD_SIZE`, at least 1).
ENV_VAR = "PEERFLOW_EMULATED_DEVICES"

_count = 1
_current = 0


def configure() -> int:
    """Reads how many devices the emulation has from the environment (at install).

    Returns:
        The device count: `$PEERFLOW_EMULATED_DEVICES`, else `$LOCAL_WORLD_SIZE` (at least 1).

    Raises:
        RuntimeError: `$PEERFLOW_EMULATED_DEVICES` is not a whole number from 1 to 127.
    """
    global _count
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        _count = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return _count
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= 127:
        raise RuntimeError(f"${ENV_VAR} must be a whole number of devices from 1 to 127 "
                           f"(a torch device index is 8 bits), got {value!r}")
    _count = count
    return count


def device_count() -> int:
    """How many emulated devices this process has."""
    return _count


def current_index() -> int:
    """The index of this process's current emulated device."""
    return _current


def current_device() -> torch.device:
    """This process's current emulated device, `emu:<current index>`."""
    return torch.device(DEVICE_TYPE, _current)


def check_index(index: int) -> int:
    """`index`, when the emulation has a device of that index.

    Raises:
        RuntimeError: "Invalid device ordinal", as CUDA says for a GPU it does not have.
    """
    if not 0 <= index < _count:
        devices = (f"one device, {DEVICE_TYPE}:0" if _count == 1
                   else f"{_count} devices, {DEVICE_TYPE}:0 to {DEVICE_TYPE}:{_count - 1}")
        raise RuntimeError(f"Invalid device ordinal {index}: the emulated accelerator has "
                           f"{devices} (${ENV_VAR}, else $LOCAL_WORLD_SIZE, at install)")
    return index


def index_of(device: Any) -> int:
    """The index `device` names: an int, a device or its name; the current one without.

    Raises:
        RuntimeError: the emulation has no device of that index.
    """
    if device is None:
        return _current
    index = device if isinstance(device, int) else torch.device(device).index
    return _current if index is None or index == -1 else check_index(index)


def set_index(device: Any) -> None:
    """Makes `device` (an index, a device or its name) current; a negative index: no-op."""
    global _current
    if isinstance(device, int) and device < 0:
        return
    _current = index_of(device)


class device_index:  # noqa: N801 (torch.accelerator's name)
    """`torch.accelerator.device_index`: makes a device current inside the block."""

    def __init__(self, device: Any, /) -> None:
        self.idx = device
        self.prev_idx = -1

    def __enter__(self) -> None:
        if self.idx is not None:
            self.prev_idx = _current
            set_index(self.idx)

    def __exit__(self, *exc_info: object) -> None:
        if self.idx is not None:
            set_index(self.prev_idx)


def _is_bare(value: Any) -> bool:
    """Whether `value` names the emulated device without an index."""
    if isinstance(value, str):
        return value == DEVICE_TYPE
    return isinstance(value, torch.device) and value.type == DEVICE_TYPE and value.index is None


def _naming_current(original: Callable[..., Any], position: int | None) -> Callable[..., Any]:
    """`original`, with a device named without an index made the current device.

    Args:
        original: A function taking `device=` (at `position` among its positional
            arguments, when it may come there).
        position: Where `device` may come among the positional arguments, or None.
    """

    @functools.wraps(original)
    def naming_current(*args: Any, **kwargs: Any) -> Any:
        if _is_bare(kwargs.get("device")):
            kwargs["device"] = current_device()
        if position is not None and len(args) > position and _is_bare(args[position]):
            args = (*args[:position], current_device(), *args[position + 1:])
        return original(*args, **kwargs)

    naming_current.__wrapped_by_emulation__ = True  # type: ignore[attr-defined]
    return naming_current


def _single_threaded(original: Callable[..., Any]) -> Callable[..., Any]:
    """Autograd's engine entry, running the backward pass on its caller's thread."""

    @functools.wraps(original)
    def run_backward(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.set_multithreading_enabled(False):
            return original(*args, **kwargs)

    return run_backward


#: (owner, name, position of `device` among the positional arguments or None): the
#: functions whose C++ side names index 0 for a device given without an index.
INDEX_FILLERS: tuple[tuple[Any, str, int | None], ...] = (
    (torch.Tensor, "to", 1), (torch.Tensor, "new_tensor", None), (torch, "tensor", None),
    (torch, "as_tensor", 2), (torch, "asarray", None),
)


def _keep_identities(wrappers: dict[Any, Callable[..., Any]]) -> None:
    """Lists that name torch functions by identity accept their wrappers too.

    `torch.nn.parameter.UninitializedTensorMixin._allowed_methods` (a lazy module's
    `.to()`). Torch function modes receive the builtins, not the wrappers: the device
    context's constructors (`with torch.device("meta")`) are read before the wrapping.
    """
    from torch.nn.parameter import UninitializedTensorMixin

    allowed = getattr(UninitializedTensorMixin, "_allowed_methods", [])
    allowed.extend(wrapper for original, wrapper in wrappers.items() if original in allowed)


def patch_torch() -> None:
    """Covers what C++ would get wrong with more than one device (a no-op with one).

    Names the current device where C++ would name device 0, and runs backward passes on
    their caller's thread (see the module's docstring).
    """
    if _count == 1:
        return
    from torch.utils import _device

    # Built now, of the builtins, which is what a torch function mode is handed (built
    # later, it would hold the wrappers, and `with torch.device(…)` would miss
    # `torch.tensor`: transformers reads its meta-device context that way).
    _device._device_constructors()
    wrappers = {}
    for owner, name, position in INDEX_FILLERS:
        original = getattr(owner, name)
        if not getattr(original, "__wrapped_by_emulation__", False):
            wrappers[original] = _naming_current(original, position)
            setattr(owner, name, wrappers[original])
    _keep_identities(wrappers)
    graph = torch.autograd.graph
    graph._engine_run_backward = torch.autograd._engine_run_backward = _single_threaded(
        graph._engine_run_backward)
