"""Packing a `Batch` into one flat byte tensor and back (byte-exact, any dtype).

Layout: `[message length: 8 bytes][header length: 8 bytes][header][pad][tensor bytes,
each padded] …`; the message length makes a packed batch a self-sized message
(`coordinator.exchange`); the header, `peerflow.wirecodec` msgpack (never a pickle), holds
`Batch.to_wire`'s metadata (field layout and Python-object fields) and each tensor's dtype
and shape. `unpack_batch` checks the header against the message (field kinds, dtypes
torch's own, shapes non-negative, every tensor inside the message) before it slices a
byte, and raises `WireFormatError` otherwise. Every tensor starts at a multiple of `ALIGN`
bytes, so `unpack_batch` returns views into the received buffer instead of copying each
tensor. `size_bound` bounds the packed size of any subset of a batch from per-sample byte
counts, so a receiver can size its buffer before the bytes arrive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from peerflow.batch import Batch, RaggedField
from peerflow.rounding import pad_to_multiple
from peerflow.wirecodec import DTYPES, WireFormatError, decode, encode

#: Byte alignment of every tensor in a packed buffer (the widest element size).
ALIGN = 16
#: Prefix: message length and header length, one int64 each.
_PREFIX = 16
#: Allowance for a subset's header being longer than the whole batch's (msgpack framing).
_HEADER_SLACK = 256


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGN` (where a packed batch or one of its tensors starts)."""
    return pad_to_multiple(nbytes, ALIGN)


#: The kinds of field `Batch.to_wire` lays out, and the tensors each one carries.
_KINDS = {"ragged": 2, "dense": 1, "objects": 0}


def _header(batch: Batch) -> tuple[bytes, list[torch.Tensor]]:
    meta, tensors = batch.to_wire()
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    layout = [list(entry) for entry in meta["layout"]]
    return encode({"layout": layout, "objects": meta["objects"], "tensors": specs}), tensors


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
    """Rebuilds the batch `pack_batch` packed; its tensors are views into `buffer`.

    Raises:
        WireFormatError: `buffer` is not a packed batch (its header or sizes disagree).
    """
    buffer = buffer.cpu()
    meta, specs, offset, end = _read_header(buffer)
    tensors = []
    for dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > end:
            raise _malformed(f"its tensors need more than its {end} bytes")
        try:  # a dtype no byte view makes (quantized, sub-byte); an empty tensor's shape
            # past int64 or whose strides overflow it
            tensor = buffer[offset : offset + nbytes].view(dtype)
            tensors.append(tensor if len(shape) == 1 else tensor.reshape(shape))
        except (RuntimeError, TypeError, ValueError) as exc:
            raise _malformed(f"{dtype} {shape}: {str(exc).splitlines()[0]}") from None
        offset += padded(nbytes)
    try:
        batch = Batch.from_wire(meta, tensors)
    except (ValueError, TypeError) as exc:  # ids or fields of disagreeing lengths
        raise _malformed(str(exc)) from None
    _check_columns(batch)
    return batch


def _check_columns(batch: Batch) -> None:
    """Refuses ids that are not int64 vectors and ragged offsets that index no values."""
    for name in ("sample_id", "group_id", "weight_version"):
        ids = getattr(batch, name)
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise _malformed(f"its {name} is {ids.dtype} {list(ids.shape)}, not int64 [rows]")
    for name, column in batch.fields.items():
        if not isinstance(column, RaggedField):
            continue
        offsets, values = column.offsets, column.values
        if (offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() == 0
                or values.dim() == 0 or int(offsets[0]) != 0
                or int(offsets[-1]) != values.shape[0]
                or bool((offsets[1:] < offsets[:-1]).any())):
            raise _malformed(f"the offsets of its ragged field {name!r} ({offsets.dtype} "
                             f"{list(offsets.shape)}) do not index its "
                             f"{list(values.shape)} values from 0, in order")


def _malformed(why: str) -> WireFormatError:
    return WireFormatError(
        f"unpack_batch: refused a malformed packed batch: {why}. The sender runs another "
        "PeerFlow version, or something other than this run's ranks wrote it (docs/"
        "operations.md, 'Trust model').")


def _read_header(buffer: torch.Tensor) -> tuple[dict[str, Any], list, int, int]:
    """The checked header of a packed batch: meta, (dtype, shape)s, first offset, end.

    The header is `{layout: [[name, kind], …], objects: {name: [value, …]}, tensors:
    [[dtype name, shape], …]}`; dtype names are torch's own (`wirecodec.DTYPES`).
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < _PREFIX:
        raise _malformed(f"{buffer.numel()} {buffer.dtype} values are no message")
    end, size = buffer[:_PREFIX].clone().view(torch.int64).tolist()
    if not _PREFIX < end <= buffer.numel() or not 0 < size <= end - _PREFIX:
        raise _malformed(f"message length {end} or header length {size} does not fit its "
                         f"{buffer.numel()} bytes")
    header = decode(buffer[_PREFIX : _PREFIX + size].numpy().tobytes(), what="batch header")
    if not isinstance(header, dict) or set(header) != {"layout", "objects", "tensors"}:
        raise _malformed("its header is not {layout, objects, tensors}")
    layout, objects, specs = header["layout"], header["objects"], header["tensors"]
    if not isinstance(layout, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and e[1] in _KINDS
            for e in layout):
        raise _malformed(f"its field layout is not [name, {'|'.join(_KINDS)}] pairs")
    named = {name for name, kind in layout if kind == "objects"}
    if not isinstance(objects, dict) or set(objects) != named or not all(
            isinstance(v, list) for v in objects.values()):
        raise _malformed("its object fields disagree with its layout")
    wanted = 3 + sum(_KINDS[kind] for _, kind in layout)
    if not isinstance(specs, list) or len(specs) != wanted or not all(_spec_ok(s) for s in specs):
        raise _malformed(f"it describes {len(specs) if isinstance(specs, list) else '?'} "
                         f"tensors, not {wanted} [torch dtype name, non-negative shape] pairs")
    meta = {"layout": [tuple(e) for e in layout], "objects": objects}
    return meta, [(DTYPES[name], shape) for name, shape in specs], padded(_PREFIX + size), end


def _spec_ok(spec: Any) -> bool:
    return (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)
            and spec[0] in DTYPES and isinstance(spec[1], list) and len(spec[1]) > 0
            and all(type(d) is int and d >= 0 for d in spec[1]))


def _row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row (`tensor[i]`) of a `[rows, *trailing]` tensor."""
    return tensor.element_size() * math.prod(tensor.shape[1:])


def size_bound(batch: Batch) -> tuple[torch.Tensor, int]:
    """Bounds the packed size of any subset of `batch`, sample by sample.

    Returns:
        `(per_sample, fixed)`: `len(pack_batch(batch.select(i)))` is at most
        `fixed + per_sample[i].sum()` for any index list `i` (up to msgpack framing of the
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
