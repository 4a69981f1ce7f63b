"""A DeepSpeed accelerator for the emulated device.

DeepSpeed does not ask `torch.accelerator` where to compute: it has its own accelerator
abstraction, which detects the CPU here. `set_accelerator()` replaces it with one for the
emulated device, so a DeepSpeed engine places its model and ZeRO partitions on `emu` and
starts its process group with the emulated device's backend (host tensors over gloo,
device tensors over `emunccl`). It is DeepSpeed's CPU accelerator (its op builders, no
pinned memory) with the device, streams and events of the emulated one, and its device
indices: `device_count()`, `set_device()`, `current_device()` and `current_device_name()`
(`emu:<current index>`) are the emulation's. DeepSpeed is imported only when this runs.
"""

from __future__ import annotations

from typing import Any

import torch


def build_accelerator() -> Any:
    """An instance of the emulated device's `DeepSpeedAccelerator` (imports DeepSpeed)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from peerflow.testing import emulated_collectives, emulated_ordinals, emulated_runtime
    from peerflow.testing.emulated_ordinals import DEVICE_TYPE

    module = getattr(torch, DEVICE_TYPE)

    class EmulatedAccelerator(CPU_Accelerator):
        """DeepSpeed's view of the emulated device (a CUDA-like, asynchronous one)."""

        def __init__(self) -> None:
            super().__init__()
            self._name = DEVICE_TYPE
            self._communication_backend_name = emulated_collectives.GROUP_BACKEND

        def is_synchronized_device(self) -> bool:
            return False

        def device_name(self, device_index: int | None = None) -> str:
            return DEVICE_TYPE if device_index is None else f"{DEVICE_TYPE}:{device_index}"

        def device(self, device_index: int | None = None) -> torch.device:
            return torch.device(DEVICE_TYPE, emulated_ordinals.index_of(device_index))

        def set_device(self, device_index: int) -> None:
            module.set_device(device_index)

        def current_device(self) -> int:
            return emulated_ordinals.current_index()

        def current_device_name(self) -> str:
            return str(emulated_ordinals.current_device())

        def device_count(self) -> int:
            return emulated_ordinals.device_count()

        def synchronize(self, device_index: int | None = None) -> None:
            module.synchronize(device_index)

        @property
        def Stream(self) -> type:  # noqa: N802 (DeepSpeed's name)
            return emulated_runtime.Stream

        def stream(self, stream: torch.Stream | None) -> Any:
            return emulated_runtime.stream(stream)

        def current_stream(self, device_index: int | None = None) -> torch.Stream:
            return emulated_runtime.current_stream(device_index)

        def default_stream(self, device_index: int | None = None) -> torch.Stream:
            return emulated_runtime.current_stream(device_index)

        @property
        def Event(self) -> type:  # noqa: N802 (DeepSpeed's name)
            return emulated_runtime.Event

        def on_accelerator(self, tensor: torch.Tensor) -> bool:
            return tensor.device.type == DEVICE_TYPE

        def get_op_builder(self, class_name: str) -> Any:
            # CUDA has no shared-memory all-reduce builder (the CPU's JIT-compiles one).
            if class_name == "ShareMemCommBuilder":
                return None
            return super().get_op_builder(class_name)

    return EmulatedAccelerator()


def set_accelerator() -> None:
    """Makes the emulated device DeepSpeed's accelerator in this process."""
    from deepspeed.accelerator import set_accelerator as set_deepspeed_accelerator

    set_deepspeed_accelerator(build_accelerator())
