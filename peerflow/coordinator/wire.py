"""Packing a `Batch` into one flat byte tensor and back (byte-exact, any dtype).

Layout: `[header length: 8 bytes][pickled header][tensor bytes …]`; the header holds
`Batch.to_wire`'s metadata (field layout and Python-object fields) and each tensor's
dtype and shape. Tensors are copied as raw bytes, so payloads arrive bit for bit.
"""

from __future__ import annotations

import pickle

import torch

from peerflow.batch import Batch


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pack_batch(batch: Batch) -> torch.Tensor:
    """Returns the batch as one contiguous `uint8` tensor (`[num_bytes]`)."""
    meta, tensors = batch.to_wire()
    specs = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    header = pickle.dumps((meta, specs), protocol=pickle.HIGHEST_PROTOCOL)
    parts = [torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8),
             torch.frombuffer(bytearray(header), dtype=torch.uint8)]
    parts += [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts)


def unpack_batch(buffer: torch.Tensor) -> Batch:
    """Rebuilds the batch `pack_batch` packed."""
    buffer = buffer.cpu()
    size = int(buffer[:8].clone().view(torch.int64)[0])
    meta, specs = pickle.loads(buffer[8 : 8 + size].numpy().tobytes())
    offset = 8 + size
    tensors = []
    for dtype_name, shape in specs:
        dtype = _dtype(dtype_name)
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        chunk = buffer[offset : offset + nbytes].clone()
        tensors.append(chunk.view(dtype).reshape(shape))
        offset += nbytes
    return Batch.from_wire(meta, tensors)
