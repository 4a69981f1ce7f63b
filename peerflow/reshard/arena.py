"""Memory a weight sync holds on one rank: the `MemoryMeter` and the reusable `Arena`.

The executor (`peerflow.reshard.executor`) packs a bucket's send buffers into the arena,
then carves the bucket's staged destination tensors from it; a destination tensor
larger than a bucket is held apart across its slices (`Arena.hold`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from peerflow.rounding import pad_to_multiple
from peerflow.shard import ShardSpec

#: Byte alignment of regions inside packed buffers (so any dtype view is legal).
ALIGN = 16


@attrs.define(eq=False)
class MemoryMeter:
    """Counts bytes the executor allocates (buffers and destination tensors)."""

    current: int = 0
    peak: int = 0

    def alloc(self, tensor: torch.Tensor) -> torch.Tensor:
        """Records `tensor` as allocated and returns it."""
        self.current += tensor.numel() * tensor.element_size()
        self.peak = max(self.peak, self.current)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Records `tensor` as released (the caller drops its last reference)."""
        self.release(tensor.numel() * tensor.element_size())

    def reserve(self, nbytes: int) -> None:
        """Records `nbytes` allocated elsewhere on this rank's behalf (receive buffers)."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def release(self, nbytes: int) -> None:
        """Records `nbytes` released."""
        self.current -= nbytes


@attrs.define(eq=False)
class Arena:
    """One reusable byte buffer per sync, carved into a bucket's tensors.

    Reusing it across buckets avoids allocating (and first-touching) fresh memory for
    every bucket; it grows to the largest bucket and is released when the sync ends.
    """

    meter: MemoryMeter
    device: Any = "cpu"
    buffer: torch.Tensor | None = None
    cursor: int = 0
    stage_bytes: int = 0
    """Size to grow to the first time a bucket stages tensors (its largest need)."""
    held: dict[str, torch.Tensor] = attrs.field(factory=dict)
    """Staged destination tensors larger than a bucket, kept across their slices."""

    def reset(self) -> None:
        """Starts carving a new bucket from offset 0."""
        self.cursor = 0

    def reserve_total(self, nbytes: int) -> None:
        """Makes room for `nbytes` in this bucket (grows the buffer when needed)."""
        if nbytes <= 0:
            return
        have = 0 if self.buffer is None else self.buffer.numel()
        if nbytes > have:
            if self.buffer is not None:
                self.meter.free(self.buffer)
                self.buffer = None
            self.buffer = self.meter.alloc(torch.empty(nbytes, dtype=torch.uint8,
                                                       device=self.device))

    def take(self, nbytes: int) -> torch.Tensor:
        """Returns the next `nbytes` (16-byte aligned) of the buffer as `uint8`."""
        assert self.buffer is not None
        start = self.cursor
        self.cursor += pad_to_multiple(nbytes, ALIGN)
        return self.buffer[start:start + nbytes]

    def hold(self, spec: ShardSpec) -> torch.Tensor:
        """The staged tensor of `spec` kept across its slices (allocated on first use)."""
        if spec.local_name not in self.held:
            tensor = self.meter.alloc(torch.empty(spec.local_shape, device=self.device,
                                                  dtype=getattr(torch, spec.dtype)))
            for box in spec.padding:
                tensor[box.slices()].zero_()
            self.held[spec.local_name] = tensor
        return self.held[spec.local_name]

    def drop(self, name: str) -> None:
        """Releases the held tensor `name` (its last slice was loaded), if staged."""
        tensor = self.held.pop(name, None)
        if tensor is not None:
            self.meter.free(tensor)

    def release(self) -> None:
        """Frees the buffer and every held tensor."""
        if self.buffer is not None:
            self.meter.free(self.buffer)
            self.buffer = None
        for name in list(self.held):
            self.drop(name)
