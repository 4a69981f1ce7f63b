"""Packing a `Batch` into one flat byte tensor and back (byte-exact, any dtype).

Layout: `[header length: 8 bytes][pickled header][pad][tensor bytes, each padded] …`; the
header holds `Batch.to_wire`'s metadata (field layout and Python-object fields) and each
tensor's dtype and shape. Every tensor starts at a multiple of `ALIGN` bytes, so
`unpack_batch` returns views into the received buffer instead of copying each tensor.
"""

from __future__ import annotations

import pickle

import torch

from peerflow.batch import Batch

#: Byte alignment of every tensor in a packed buffer (the widest element size).
ALIGN = 16


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pack_batch(batch: Batch) -> torch.Tensor:
    """Returns the batch as one contiguous `uint8` tensor (`[num_bytes]`), one copy."""
    meta, tensors = batch.to_wire()
    specs = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    header = pickle.dumps((meta, specs), protocol=pickle.HIGHEST_PROTOCOL)
    sizes = [t.numel() * t.element_size() for t in tensors]
    start = _padded(8 + len(header))
    out = torch.zeros(start + sum(_padded(n) for n in sizes), dtype=torch.uint8)
    out[:8] = torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8)
    out[8 : 8 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for tensor, nbytes in zip(tensors, sizes):
        if nbytes:
            out[start : start + nbytes] = tensor.detach().cpu().reshape(-1).view(torch.uint8)
        start += _padded(nbytes)
    return out


def unpack_batch(buffer: torch.Tensor) -> Batch:
    """Rebuilds the batch `pack_batch` packed; its tensors are views into `buffer`."""
    buffer = buffer.cpu()
    size = int(buffer[:8].clone().view(torch.int64)[0])
    meta, specs = pickle.loads(buffer[8 : 8 + size].numpy().tobytes())
    offset = _padded(8 + size)
    tensors = []
    for dtype_name, shape in specs:
        dtype = _dtype(dtype_name)
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        tensors.append(buffer[offset : offset + nbytes].view(dtype).reshape(shape))
        offset += _padded(nbytes)
    return Batch.from_wire(meta, tensors)
