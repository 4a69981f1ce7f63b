"""Packing a `Batch` into one flat byte tensor and back (byte-exact, any dtype).

Layout: `[message length: 8 bytes][header length: 8 bytes][pickled header][pad][tensor
bytes, each padded] …`; the message length makes a packed batch a self-sized message
(`coordinator.exchange`); the header holds `Batch.to_wire`'s metadata (field layout and
Python-object fields) and each tensor's dtype and shape. Every tensor starts at a multiple
of `ALIGN` bytes, so `unpack_batch` returns views into the received buffer instead of
copying each tensor. `size_bound` bounds the packed size of any subset of a batch from
per-sample byte counts, so a receiver can size its buffer before the bytes arrive.
"""

from __future__ import annotations

import functools
import math
import pickle
from collections.abc import Sequence

import torch

from peerflow.batch import Batch, RaggedField
from peerflow.rounding import pad_to_multiple

#: Byte alignment of every tensor in a packed buffer (the widest element size).
ALIGN = 16
#: Prefix: message length and header length, one int64 each.
_PREFIX = 16
#: Allowance for a subset's header being longer than the whole batch's (pickle framing).
_HEADER_SLACK = 256


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGN` (where a packed batch or one of its tensors starts)."""
    return pad_to_multiple(nbytes, ALIGN)


@functools.cache
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _header(batch: Batch) -> tuple[bytes, list[torch.Tensor]]:
    meta, tensors = batch.to_wire()
    specs = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    return pickle.dumps((meta, specs), protocol=pickle.HIGHEST_PROTOCOL), tensors


def pack_batch(batch: Batch, reserve: int = 0) -> torch.Tensor:
    """Returns the batch as one contiguous `uint8` tensor (`[num_bytes]`), one copy.

    Args:
        batch: The batch.
        reserve: Leading bytes left free for the caller (a multiple of `ALIGN`); the
            packed batch is `out[reserve:]`.
    """
    if reserve % ALIGN:
        raise ValueError(f"pack_batch: reserve={reserve} is not a multiple of {ALIGN}.")
    header, tensors = _header(batch)
    sizes = [t.numel() * t.element_size() for t in tensors]
    start = padded(_PREFIX + len(header))
    out = torch.zeros(reserve + start + sum(padded(n) for n in sizes), dtype=torch.uint8)
    body = out[reserve:]
    body[:_PREFIX] = torch.tensor([body.numel(), len(header)], dtype=torch.int64).view(torch.uint8)
    body[_PREFIX : _PREFIX + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for tensor, nbytes in zip(tensors, sizes):
        if nbytes:
            body[start : start + nbytes] = tensor.detach().cpu().reshape(-1).view(torch.uint8)
        start += padded(nbytes)
    return out


def unpack_batch(buffer: torch.Tensor) -> Batch:
    """Rebuilds the batch `pack_batch` packed; its tensors are views into `buffer`."""
    buffer = buffer.cpu()
    size = int(buffer[8:_PREFIX].clone().view(torch.int64)[0])
    meta, specs = pickle.loads(buffer[_PREFIX : _PREFIX + size].numpy().tobytes())
    offset = padded(_PREFIX + size)
    tensors = []
    for dtype_name, shape in specs:
        dtype = _dtype(dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        tensor = buffer[offset : offset + nbytes].view(dtype)
        tensors.append(tensor if len(shape) == 1 else tensor.reshape(shape))
        offset += padded(nbytes)
    return Batch.from_wire(meta, tensors)


def _row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row (`tensor[i]`) of a `[rows, *trailing]` tensor."""
    return tensor.element_size() * math.prod(tensor.shape[1:])


def size_bound(batch: Batch) -> tuple[torch.Tensor, int]:
    """Bounds the packed size of any subset of `batch`, sample by sample.

    Returns:
        `(per_sample, fixed)`: `len(pack_batch(batch.select(i)))` is at most
        `fixed + per_sample[i].sum()` for any index list `i` (up to pickle framing of the
        Python-object fields, which `_HEADER_SLACK` covers; `exchange` sends a second
        message if a subset ever exceeds it).
    """
    header, tensors = _header(batch)
    per_sample = torch.full((len(batch),), 3 * 8, dtype=torch.int64)  # sample, group, version
    extra = 0  # the extra offsets entry of each ragged field
    for column in batch.fields.values():
        if isinstance(column, RaggedField):
            per_sample += column.lengths * _row_bytes(column.values) + 8
            extra += 8
        elif isinstance(column, torch.Tensor):
            per_sample += _row_bytes(column)
    fixed = _PREFIX + len(header) + _HEADER_SLACK + extra + ALIGN * (len(tensors) + 1)
    return per_sample, fixed


def spans_bytes(batch: Batch, spans: Sequence[tuple[int, int]]) -> int:
    """Tensor bytes of the samples `start:stop` of each span (ids, rows, offsets entries)."""
    rows = sum(stop - start for start, stop in spans)
    total = 3 * 8 * rows  # sample, group, version
    offsets: dict[int, list[int]] = {}  # fields sharing an offsets tensor read it once
    for column in batch.fields.values():
        if isinstance(column, RaggedField):
            known = offsets.setdefault(id(column.offsets), column.offsets.tolist())
            tokens = sum(known[stop] - known[start] for start, stop in spans)
            total += tokens * _row_bytes(column.values) + 8 * rows
        elif isinstance(column, torch.Tensor):
            total += _row_bytes(column) * rows
    return total
