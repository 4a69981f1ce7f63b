"""A storage shared with a process on the same host, as plain values and back (no pickle).

`cuda_ipc` hands a peer the whole storage behind its buckets once. torch's multiprocessing
reduction (`reduce_tensor`, `reduce_storage`) describes such a storage as a rebuild
function and its arguments; pickling that pair, as `ForkingPickler` does, would let
whoever writes the bytes name the function the receiver calls. Here the sender keeps only
the arguments — ints, bytes and booleans, encoded by `peerflow.wirecodec` — and the
receiver calls the rebuild function it picks itself from the export's kind:

* `cuda`: `storage._share_cuda_()`'s eight values (device index, CUDA IPC memory handle,
  storage size and offset in its allocation, the producer's reference-counter file and
  offset, event handle, whether the event must be waited), rebuilt by
  `rebuild_cuda_tensor` as a flat `uint8` tensor over the whole storage;
* `host`: a shared-memory storage by name (`reduce_storage` under the `file_system`
  sharing strategy: the manager socket, the storage name, its size), rebuilt by
  `rebuild_storage_filename` — how the tests run the same protocol without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from peerflow.wirecodec import WireFormatError, decode, encode

__all__ = ["export_storage", "open_export"]

#: Per kind: the types of its values, in order (`bytes | None`: `None` allowed).
_SCHEMA: dict[str, tuple[tuple[type, ...], ...]] = {
    "cuda": ((int,), (bytes, type(None)), (int,), (int,), (bytes,), (int,),
             (bytes, type(None)), (bool,)),
    "host": ((bytes,), (bytes,), (int,)),
}


def export_storage(whole: torch.Tensor) -> bytes:
    """The encoded export of `whole`, a flat `uint8` tensor over its entire storage.

    Raises:
        RuntimeError: host memory under the `file_descriptor` sharing strategy (its
            export is a file descriptor, which cannot travel over a process group).
    """
    from torch.multiprocessing import get_sharing_strategy
    from torch.multiprocessing.reductions import reduce_storage, reduce_tensor

    if whole.is_cuda:
        _, args = reduce_tensor(whole)  # also registers the storage in torch's shared cache
        # (device, handle, storage bytes, storage offset, ref counter, its offset, event,
        # event sync required): `_share_cuda_`'s values, around `requires_grad` (args[10]).
        return encode({"kind": "cuda", "values": [*args[6:10], *args[11:15]]})
    if get_sharing_strategy() != "file_system":
        raise RuntimeError(
            "cuda_ipc on host memory shares storages by name: call torch.multiprocessing."
            "set_sharing_strategy('file_system') in every rank first (a file descriptor "
            "cannot travel over a process group).")
    _, args = reduce_storage(whole.untyped_storage())
    return encode({"kind": "host", "values": list(args[1:4])})


def open_export(data: bytes, *, peer: int) -> torch.Tensor:
    """Maps `export_storage`'s bytes from rank `peer`: a flat `uint8` tensor over them.

    Raises:
        WireFormatError: the bytes are not an export (corrupt, or crafted).
    """
    what = f"CUDA IPC export from rank {peer}"
    export = decode(data, what=what)
    kind, values = _checked(export, what)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_storage_filename

    if kind == "cuda":
        device, handle, size, offset, counter, counter_offset, event, sync = values
        return rebuild_cuda_tensor(torch.Tensor, (size,), (1,), 0, torch.storage.TypedStorage,
                                   torch.uint8, device, handle, size, offset, False, counter,
                                   counter_offset, event, sync)
    storage = rebuild_storage_filename(torch.UntypedStorage, *values)
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return whole


def _checked(export: Any, what: str) -> tuple[str, list]:
    """The export's kind and values, each of its schema's type."""
    schema = _SCHEMA.get(export.get("kind")) if isinstance(export, dict) else None
    values = export.get("values") if schema is not None else None
    if (schema is None or set(export) != {"kind", "values"} or not isinstance(values, list)
            or len(values) != len(schema)
            or not all(type(v) in types for v, types in zip(values, schema))
            or any(type(v) is int and v < 0 for v in values)):
        raise WireFormatError(
            f"refused a malformed {what}: not one of {sorted(_SCHEMA)} with its values "
            f"({export!r:.200}). The ranks run different PeerFlow versions, or something "
            "other than this run's ranks wrote it (docs/operations.md, 'Trust model').")
    return export["kind"], values
