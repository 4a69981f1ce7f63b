"""The runtime around the emulated device: its `torch.emu` module, streams, RNG, memory.

Registered as the `PrivateUse1` backend's device module (`torch._register_device_module`),
this is what device-generic code reaches through `torch.accelerator`, FSDP2's device
handle (`getattr(torch, device.type)`), `torch.autocast("emu")` and `torch.manual_seed`.
Everything runs synchronously on the CPU, so streams and events only keep the bookkeeping
that callers read back. Random numbers come from the CPU generator, so a seeded run draws
the same values on the emulated device as on the CPU (one generator serves every index).
The device indices (how many, which is current) are `emulated_ordinals`'.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from peerflow.testing import emulated_ordinals
from peerflow.testing.emulated_tensor import DEVICE_TYPE, EMULATED_GENERATORS, EmulatedTensor

#: What `get_device_name()` reports.
DEVICE_NAME = "PeerFlow emulated accelerator (CPU values)"


def _device_type_code() -> int:
    return int(torch._C._autograd.DeviceType.PrivateUse1)


class Stream(torch.Stream):
    """A stream of the emulated device (work runs at once; ordering calls are no-ops)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        """A stream on the emulated `device` (the current one when None or no index)."""
        return super().__new__(cls, stream_id=0, device_index=emulated_ordinals.index_of(device),
                               device_type=_device_type_code())


class Event(torch.Event):
    """An event of the emulated device: recorded work is already done."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False) -> Event:
        """An event on the emulated device."""
        event = super().__new__(cls, device=DEVICE_TYPE, enable_timing=enable_timing,
                                blocking=blocking, interprocess=interprocess)
        event._recorded_at = None
        return event

    def record(self, stream: torch.Stream | None = None) -> None:
        """Records the event (and the time, for `elapsed_time`)."""
        self._recorded_at = time.perf_counter()
        super().record(stream)

    def synchronize(self) -> None:
        """Waits for the event: recorded work is already done."""

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event's record and `end_event`'s."""
        if self._recorded_at is None or getattr(end_event, "_recorded_at", None) is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


def _check_device(device: Any) -> None:
    emulated_ordinals.index_of(device)


def current_stream(device: Any = None) -> torch.Stream:
    """The stream work is issued on: the default stream of `device` (None: the current)."""
    return torch.Stream(stream_id=0, device_index=emulated_ordinals.index_of(device),
                        device_type=_device_type_code())


@contextlib.contextmanager
def stream(selected: torch.Stream | None) -> Iterator[None]:
    """Issues work on `selected` inside the block (like `torch.cuda.stream`)."""
    if selected is None:
        yield
        return
    previous = torch.accelerator.current_stream()
    torch.accelerator.set_stream(selected)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


def set_device(device: Any) -> None:
    """Makes `device` (an index, a device or its name) the current device."""
    emulated_ordinals.set_index(device)


def _rng_states() -> list[torch.Tensor]:
    return [torch.get_rng_state()] * emulated_ordinals.device_count()


def _set_rng_states(states: Any) -> None:
    torch.set_rng_state(states[emulated_ordinals.current_index()])


def _rng_state(device: Any = None) -> torch.Tensor:
    _check_device(device)
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    _check_device(device)
    torch.set_rng_state(state)


def _seed(value: int) -> None:
    torch.default_generator.manual_seed(int(value))


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    import os

    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    free = os.sysconf("SC_AVPHYS_PAGES") * size
    return free, pages * size


def build_device_module() -> types.ModuleType:
    """The module registered as `torch.emu` (the device module of `PrivateUse1`)."""
    module = types.ModuleType(f"torch.{DEVICE_TYPE}", __doc__)
    zero: Callable[..., int] = lambda device=None: 0  # noqa: E731
    nothing: Callable[..., None] = lambda *args, **kwargs: None  # noqa: E731
    # No bfloat16 compute: autocast is a no-op here (it would run float32 next to
    # bfloat16 masks), so `trainer.bf16: auto` resolves to float32 on this device.
    module.__dict__.update(
        is_available=lambda: True, is_initialized=lambda: True, _is_in_bad_fork=lambda: False,
        _lazy_init=nothing, init=nothing, is_bf16_supported=lambda *args, **kwargs: False,
        device_count=emulated_ordinals.device_count,
        current_device=emulated_ordinals.current_index, set_device=set_device,
        device=emulated_ordinals.device_index,
        get_device_name=lambda device=None: DEVICE_NAME,
        synchronize=lambda device=None: _check_device(device), Stream=Stream, Event=Event,
        current_stream=current_stream, default_stream=current_stream, stream=stream,
        set_stream=lambda selected: torch.accelerator.set_stream(selected),
        manual_seed=_seed, manual_seed_all=_seed, seed=torch.seed, seed_all=torch.seed,
        initial_seed=torch.initial_seed, get_rng_state=_rng_state, set_rng_state=_set_rng_state,
        get_rng_state_all=_rng_states, set_rng_state_all=_set_rng_states,
        default_generators=(torch.default_generator,) * emulated_ordinals.device_count(),
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16],
        memory_allocated=zero, max_memory_allocated=zero, memory_reserved=zero,
        max_memory_reserved=zero, reset_peak_memory_stats=nothing,
        reset_accumulated_memory_stats=nothing, empty_cache=nothing,
        memory_stats=lambda device=None: {}, mem_get_info=_mem_get_info,
    )
    return module


class _GeneratorMeta(type(torch._C.Generator)):
    """Keeps `isinstance(g, torch.Generator)` true for every generator torch makes."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch._C.Generator)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_GeneratorMeta):
    """`torch.Generator` that also accepts the emulated device.

    A Python-registered backend cannot make generators of its own, so one for the
    emulated device is a CPU generator that reports the emulated device: operators on
    emulated tensors draw from it on their CPU values, as CUDA kernels draw from a CUDA
    generator.
    """

    def __new__(cls, device: Any = "cpu") -> Generator:
        """A generator for `device` (the emulated one is backed by a CPU generator)."""
        device = torch.device(device)
        emulated = device.type == DEVICE_TYPE
        index = emulated_ordinals.index_of(device) if emulated else None
        generator = super().__new__(cls, "cpu" if emulated else device)
        generator._emulated = emulated
        generator._index = index
        if emulated:
            EMULATED_GENERATORS.add(generator._cdata)
            weakref.finalize(generator, EMULATED_GENERATORS.discard, generator._cdata)
        return generator

    @property
    def device(self) -> torch.device:
        """The device this generator serves."""
        if self._emulated:
            return torch.device(DEVICE_TYPE, self._index)
        return super().device


def _accelerator_patch(original: Callable[..., Any], emulated: Callable[..., Any]
                       ) -> Callable[..., Any]:
    @functools.wraps(original, updated=())  # `original` may be a class (`device_index`)
    def patched(*args: Any, **kwargs: Any) -> Any:
        current = torch.accelerator.current_accelerator()
        if current is not None and current.type == DEVICE_TYPE:
            return emulated(*args, **kwargs)
        return original(*args, **kwargs)

    # torch.compile asks the accelerator for its stream while it compiles: it must call
    # these Python functions, not trace them (tracing them asks again, forever)
    return torch.compiler.disable(patched, recursive=True)


def _device_index(device: Any) -> int:
    """torch.accelerator's reading of a device argument that must name an index."""
    from torch.accelerator._utils import _get_device_index

    return _get_device_index(device, optional=False)


#: `torch.accelerator` functions a Python-registered backend cannot serve (they reach C++
#: allocator, synchronisation and device-index hooks it has no way to provide; its C++
#: device guard knows device 0 only): what they do instead.
ACCELERATOR_FALLBACKS: dict[str, Callable[..., Any]] = {
    "synchronize": lambda device=None: _check_device(device),
    "current_device_index": emulated_ordinals.current_index,
    "current_device_idx": emulated_ordinals.current_index,
    "set_device_index": lambda device: set_device(_device_index(device)),
    "set_device_idx": lambda device: set_device(_device_index(device)),
    "device_index": emulated_ordinals.device_index,
    "current_stream": current_stream,
    "set_stream": lambda stream: set_device(stream.device_index),
    "memory_allocated": lambda device_index=None: 0,
    "max_memory_allocated": lambda device_index=None: 0,
    "memory_reserved": lambda device_index=None: 0,
    "max_memory_reserved": lambda device_index=None: 0,
    "reset_peak_memory_stats": lambda device_index=None: None,
    "reset_accumulated_memory_stats": lambda device_index=None: None,
    "empty_cache": lambda: None,
    "memory_stats": lambda device_index=None: {},
}


class _WeakrefsOf:
    """`weakref` as `torch.utils` sees it while it swaps a tensor onto the device."""

    def __init__(self, ignored: torch.Tensor) -> None:
        self._ignored = ignored

    def getweakrefs(self, target: Any) -> list[Any]:
        return [] if target is self._ignored else weakref.getweakrefs(target)

    def __getattr__(self, name: str) -> Any:
        return getattr(weakref, name)


_swap_lock = threading.Lock()


def _swap_tensors_patch(original: Callable[[torch.Tensor, torch.Tensor], None]
                        ) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`torch.utils.swap_tensors`, also for a host tensor that has weak references.

    `Module.to("emu")` swaps each parameter with its emulated copy (on CUDA it assigns
    `.data` instead, which a wrapper subclass cannot take), and `swap_tensors` refuses a
    tensor with weak references; DeepSpeed keeps one on every parameter
    (`WeakIdNameMap`). The swap keeps the Python object, so its weak references stay
    valid: the check is skipped for a swap onto the emulated device.
    """

    @functools.wraps(original)
    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not isinstance(t2, EmulatedTensor) or weakref.getweakrefs(t2):
            return original(t1, t2)
        utils = sys.modules["torch.utils"]
        with _swap_lock:
            utils.weakref = _WeakrefsOf(t1)
            try:
                return original(t1, t2)
            finally:
                utils.weakref = weakref

    return swap_tensors


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    """`Tensor.pin_memory`: an unpinned copy (a Python backend has no pinned allocator)."""
    if self.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
    return self.clone()


def patch_torch() -> None:
    """Installs `Generator`, `pin_memory`, the `torch.accelerator` fallbacks, the swap, load."""
    from peerflow.testing.emulated_serialization import patch_load

    patch_load()
    torch.Generator = Generator
    torch.Tensor.pin_memory = _pin_memory
    torch.utils.swap_tensors = _swap_tensors_patch(torch.utils.swap_tensors)
    for name, emulated in ACCELERATOR_FALLBACKS.items():
        original = getattr(torch.accelerator, name, None)
        if original is not None:
            setattr(torch.accelerator, name, _accelerator_patch(original, emulated))
