"""A shared-memory buffer that carries weight buckets into vLLM's worker processes.

vLLM serialises `collective_rpc` arguments, so tensors cannot travel as arguments to
worker processes. The engine instead writes each bucket into one file on a tmpfs
(`/dev/shm`) that the caller and every worker map with `torch.from_file(shared=True)`,
and sends only the layout `(tp_rank, name, byte_offset, shape, dtype)`. The rpc returns
after every worker has copied its tensors, so the buffer is free for the next bucket.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence

import attrs
import torch

from peerflow.rounding import pad_to_multiple

#: Every tensor starts at a multiple of this many bytes (any dtype's alignment).
ALIGN = 64

Entry = tuple[int, str, torch.Tensor]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@attrs.define(eq=False)
class SharedBuffer:
    """A fixed-size shared-memory file mapped as a flat `uint8` tensor."""

    path: str
    """File path (under a tmpfs such as `/dev/shm`)."""
    nbytes: int
    """Capacity in bytes."""
    data: torch.Tensor
    """The mapping, `[nbytes]` uint8."""

    @classmethod
    def create(cls, directory: str, nbytes: int) -> SharedBuffer:
        """Creates a zero-filled buffer file of `nbytes` in `directory`.

        Raises:
            FileNotFoundError: `directory` does not exist (set `rollout.vllm.shm_dir`).
        """
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"rollout.vllm.shm_dir={directory!r} is not a directory; point it at a tmpfs "
                "such as /dev/shm."
            )
        fd, path = tempfile.mkstemp(prefix="peerflow-vllm-", suffix=".bin", dir=directory)
        os.close(fd)
        data = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return cls(path=path, nbytes=nbytes, data=data)

    def chunks(self, entries: Sequence[Entry]) -> Iterator[list[Entry]]:
        """Splits a bucket into runs that fit the buffer, keeping the entries' order.

        Raises:
            ValueError: one tensor alone is larger than the buffer.
        """
        chunk: list[Entry] = []
        used = 0
        for entry in entries:
            size = pad_to_multiple(_nbytes(entry[2]), ALIGN)
            if size > self.nbytes:
                raise ValueError(
                    f"tensor {entry[1]!r} takes {size} bytes, more than the shared buffer's "
                    f"{self.nbytes}; raise rollout.vllm.shm_bytes."
                )
            if used + size > self.nbytes:
                yield chunk
                chunk, used = [], 0
            chunk.append(entry)
            used += size
        if chunk:
            yield chunk

    def write(self, entries: Sequence[Entry]) -> list[tuple[int, str, int, tuple[int, ...], str]]:
        """Copies tensors into the buffer back to back and returns their layout."""
        layout = []
        offset = 0
        for tp_rank, name, tensor in entries:
            size = _nbytes(tensor)
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            self.data[offset : offset + size].copy_(flat.cpu())
            dtype = str(tensor.dtype).removeprefix("torch.")
            layout.append((tp_rank, name, offset, tuple(tensor.shape), dtype))
            offset += pad_to_multiple(size, ALIGN)
        return layout

    def close(self) -> None:
        """Unmaps and deletes the file. Safe to call twice."""
        self.data = torch.empty(0, dtype=torch.uint8)
        if os.path.exists(self.path):
            os.unlink(self.path)
