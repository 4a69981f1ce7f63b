"""Values between processes as msgpack with a fixed type table: nothing received is unpickled.

Every header or payload one PeerFlow process decodes from another — a packed batch's
header (`coordinator.wire`), a streaming report or patch (`streaming.transport`), a CUDA
IPC export (`reshard.ipc_handles`) — goes through `encode` and `decode`. A peer that can
write those bytes (a rank gone wrong, or anyone who makes two ranks disagree through a
store) can at most make `decode` raise `WireFormatError`: decoding builds plain values
and the types of the table below, never an object a peer names, and never runs code.

msgpack carries `None`, `bool`, `int` (64-bit), `float`, `str`, `bytes`, `list` and
`dict` natively; what it lacks travels as a msgpack extension type from `TYPE_TABLE`:

| code | type | payload |
|---|---|---|
| 1 | `tuple` | the items, as a msgpack array |
| 2 | `torch.dtype` | its name (`float32`); only torch's own dtypes decode |
| 3 | host `torch.Tensor` | `[dtype name, shape, raw bytes]` (device tensors travel as host) |
| 4 | numpy array or scalar | `[dtype string, shape, raw bytes, is_scalar]`; numeric and bool |
| 5 | `int` past 64 bits | its decimal digits |
| 6 | an attrs instance of a class `register`ed on both ends | `[name, {field: value}]` |

Any other extension code is refused. Subclasses of `dict`, `list`, `str`, `int` and `float`
travel as the base type (an `IntEnum` arrives as an `int`); any other type is a
`TypeError` at the sender naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import numpy as np
import torch

from peerflow.errors import PeerFlowError

__all__ = ["DTYPES", "MAX_DEPTH", "NUMPY_DTYPES", "TYPE_TABLE", "WireFormatError", "decode",
           "encode", "register"]

TUPLE, DTYPE, TENSOR, NDARRAY, BIGINT, ATTRS = 1, 2, 3, 4, 5, 6
#: Extension code → the type it carries (the module docstring's table).
TYPE_TABLE = {TUPLE: "tuple", DTYPE: "torch.dtype", TENSOR: "torch.Tensor",
              NDARRAY: "numpy.ndarray", BIGINT: "int", ATTRS: "attrs class"}
#: Deepest nesting of tagged values (tuples in tuples, …) `decode` accepts.
MAX_DEPTH = 64
#: torch's own dtypes by name: the only ones a received name may become.
DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
#: numpy's numeric and bool dtypes by `dtype.str`, both byte orders: the only ones a
#: received string may become (never parsed: `np.dtype` evaluates comma strings).
NUMPY_DTYPES: dict[str, np.dtype] = {
    dt.str: dt for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                            "uint32", "uint64", "float16", "float32", "float64", "complex64",
                            "complex128", "longdouble", "clongdouble")
    for dt in (np.dtype(name), np.dtype(name).newbyteorder())}
_REGISTRY: dict[str, type] = {}
_PLAIN = (dict, list, str, int, float)


class WireFormatError(PeerFlowError, ValueError):
    """Received bytes are not a well-formed PeerFlow message (corrupt, or crafted)."""


def register(cls: type) -> type:
    """Allows instances of the attrs class `cls` on the wire (usable as a decorator).

    Both ends must register it (importing the module that does is enough); an instance
    is rebuilt through `cls(**fields)`, so its validators run on what arrives.

    Raises:
        TypeError: `cls` is not an attrs class.
    """
    if not attrs.has(cls):
        raise TypeError(f"wirecodec.register: {cls!r} is not an attrs class; only attrs "
                        "classes (their init fields) travel by name.")
    _REGISTRY[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return cls


def _pack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)
    except UnicodeEncodeError:  # a lone surrogate (json.loads makes them): the slower path
        return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True,
                             unicode_errors="surrogatepass")


def encode(obj: Any) -> bytes:
    """Encodes `obj` (plain values and the types of `TYPE_TABLE`) as msgpack bytes.

    Raises:
        TypeError: `obj` holds a value of a type outside the table (named in the message).
    """
    return _pack(obj)


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, tuple):
        return msgpack.ExtType(TUPLE, _pack(list(obj)))
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(DTYPE, str(obj).removeprefix("torch.").encode())
    if isinstance(obj, torch.Tensor):
        host = obj.detach().cpu().contiguous()
        raw = host.reshape(-1).view(torch.uint8).numpy().tobytes()
        name = str(host.dtype).removeprefix("torch.")
        return msgpack.ExtType(TENSOR, _pack([name, list(host.shape), raw]))
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.str in NUMPY_DTYPES:
        array = np.asarray(obj)  # a scalar as 0-d; `tobytes` is C order
        return msgpack.ExtType(NDARRAY, _pack([array.dtype.str, list(array.shape),
                                               array.tobytes(), isinstance(obj, np.generic)]))
    if type(obj) is int:  # past 64 bits (msgpack packs the rest)
        return msgpack.ExtType(BIGINT, str(obj).encode())
    if attrs.has(type(obj)):
        name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if _REGISTRY.get(name) is type(obj):
            fields = {f.alias: getattr(obj, f.name) for f in attrs.fields(type(obj)) if f.init}
            return msgpack.ExtType(ATTRS, _pack([name, fields]))
    for plain in _PLAIN:
        if isinstance(obj, plain):
            return plain(obj)
    raise TypeError(
        f"wirecodec: a {type(obj).__module__}.{type(obj).__qualname__} cannot travel between "
        f"processes: values are plain (None, bool, int, float, str, bytes, list, dict) or of "
        f"the type table ({', '.join(TYPE_TABLE.values())}). Convert it to plain values, or "
        "register its attrs class with peerflow.wirecodec.register on both ends.")


def decode(data: bytes | bytearray | memoryview, *, what: str = "message") -> Any:
    """Decodes `encode`'s bytes; anything else raises `WireFormatError`.

    Args:
        data: The bytes, exactly (trailing bytes are refused).
        what: What the bytes are, for the error message.

    Raises:
        WireFormatError: the bytes are not one well-formed value of the table.
    """
    try:
        return _Decoder(what).unpack(data)
    except WireFormatError:
        raise
    except (ValueError, TypeError, KeyError, OverflowError, RuntimeError, MemoryError,
            msgpack.UnpackException) as exc:
        raise WireFormatError(_refusal(what, f"{type(exc).__name__}: {exc}")) from None


def _refusal(what: str, why: str) -> str:
    return (f"refused a malformed {what} ({why}). PeerFlow decodes only its own msgpack "
            "format and never unpickles received bytes: the sender runs another PeerFlow "
            "version, or something other than this run's ranks wrote it (docs/operations.md, "
            "'Trust model').")


@attrs.define(eq=False)
class _Decoder:
    """One `decode` call: the extension hook and its nesting depth."""

    what: str
    depth: int = 0

    def unpack(self, data: bytes | bytearray | memoryview) -> Any:
        return msgpack.unpackb(data, ext_hook=self.ext, raw=False, strict_map_key=False,
                               unicode_errors="surrogatepass")

    def fail(self, why: str) -> WireFormatError:
        return WireFormatError(_refusal(self.what, why))

    def ext(self, code: int, data: bytes) -> Any:
        read = _READERS.get(code)
        if read is None:
            raise self.fail(f"extension type {code} is not in the type table "
                            f"{sorted(TYPE_TABLE)}")
        if self.depth >= MAX_DEPTH:
            raise self.fail(f"tagged values nested deeper than {MAX_DEPTH}")
        self.depth += 1
        try:
            return read(self, data)
        finally:
            self.depth -= 1

    def items(self, data: bytes, kind: str, count: int) -> list:
        items = self.unpack(data)
        if not isinstance(items, list) or len(items) != count:
            raise self.fail(f"a {kind} is not {count} items")
        return items

    def dtype(self, name: Any) -> torch.dtype:
        if not isinstance(name, str) or name not in DTYPES:
            raise self.fail(f"{name!r} is not a torch dtype")
        return DTYPES[name]

    def shape(self, shape: Any, nbytes: int, itemsize: int) -> list[int]:
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise self.fail(f"shape {shape!r} is not a list of non-negative ints")
        if math.prod(shape) * itemsize != nbytes:
            raise self.fail(f"shape {shape} of {itemsize}-byte items is not {nbytes} bytes")
        return shape


def _tuple(dec: _Decoder, data: bytes) -> tuple:
    items = dec.unpack(data)
    if not isinstance(items, list):
        raise dec.fail("a tuple is not an array")
    return tuple(items)


def _tensor(dec: _Decoder, data: bytes) -> torch.Tensor:
    name, shape, raw = dec.items(data, "tensor", 3)
    dtype = dec.dtype(name)
    if not isinstance(raw, bytes):
        raise dec.fail("a tensor's data is not bytes")
    shape = dec.shape(shape, len(raw), dtype.itemsize)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _ndarray(dec: _Decoder, data: bytes) -> Any:
    text, shape, raw, scalar = dec.items(data, "numpy array", 4)
    dtype = NUMPY_DTYPES.get(text) if isinstance(text, str) else None
    if dtype is None or not isinstance(raw, bytes):
        raise dec.fail(f"numpy dtype {text!r} is not a numeric or bool dtype, or its data "
                       "is not bytes")
    array = np.frombuffer(raw, dtype=dtype).reshape(dec.shape(shape, len(raw), dtype.itemsize))
    return array[()] if scalar is True and not shape else array.copy()


def _bigint(dec: _Decoder, data: bytes) -> int:
    if len(data) > 4000 or not data.lstrip(b"-").isdigit():
        raise dec.fail("a big int is not decimal digits")
    return int(data)


def _attrs(dec: _Decoder, data: bytes) -> Any:
    name, fields = dec.items(data, "attrs value", 2)
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None or not isinstance(fields, dict):
        raise dec.fail(f"class {name!r} is not registered with peerflow.wirecodec.register")
    return cls(**fields)


_READERS: dict[int, Callable[[_Decoder, bytes], Any]] = {
    TUPLE: _tuple, DTYPE: lambda dec, data: dec.dtype(data.decode(errors="replace")),
    TENSOR: _tensor, NDARRAY: _ndarray, BIGINT: _bigint, ATTRS: _attrs}
