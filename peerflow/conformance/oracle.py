"""The oracle resharder: naive and independent of the code under test.

It never calls `plan_reshard` or the executor. It assembles every full HF tensor from the
replica-0 source pieces (counting how often each element is written), then cuts each
destination tensor out of the full tensors. Global tensors come from `torch.arange`, so
every element is unique and a misplaced element shows up as a wrong value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from peerflow.shard import ShardSpec

#: float32 holds integers exactly up to 2**24; `arange_globals` stays below it.
EXACT_LIMIT = 2**24


def arange_globals(shapes: Mapping[str, Sequence[int]], dtype: torch.dtype = torch.float32,
                   start: int = 1) -> dict[str, torch.Tensor]:
    """Returns one tensor per HF name whose elements are consecutive distinct integers.

    Values start at `start` (default 1, so a zero-filled destination that was never
    written is visible). Raises `ValueError` when the model is too large for `dtype`
    to hold every value exactly.
    """
    out: dict[str, torch.Tensor] = {}
    cursor = start
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = torch.arange(cursor, cursor + n, dtype=torch.float64).reshape(tuple(shape))
        cursor += n
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and cursor > EXACT_LIMIT:
        raise ValueError(f"arange_globals: {cursor} elements exceed the exact range of {dtype}; "
                         "use smaller test shapes or dtype=torch.float64.")
    return {name: t.to(dtype) for name, t in out.items()}


def cut(spec: ShardSpec, full: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Returns the local tensor `spec` describes, cut from full HF tensors (padding zero)."""
    dtype = getattr(torch, spec.dtype)
    local = torch.zeros(spec.local_shape, dtype=dtype)
    for piece in spec.pieces:
        local[piece.local_box.slices()] = full[piece.name][piece.global_box.slices()].to(dtype)
    return local


def shard_all(specs: Mapping[int, Sequence[ShardSpec]],
              full: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Returns every rank's local tensors cut from full HF tensors."""
    return {rank: {s.local_name: cut(s, full) for s in items} for rank, items in specs.items()}


class OracleError(AssertionError):
    """The sources given to the oracle do not describe every element exactly once."""


def assemble(sources: Mapping[int, Sequence[ShardSpec]],
             tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rebuilds full HF tensors from replica-0 source tensors.

    Elements no replica-0 piece holds are taken from duplicates (`replica > 0`), lowest
    replica first.

    Raises:
        OracleError: an element is written twice or never (names parameter and count).
    """
    full: dict[str, torch.Tensor] = {}
    count: dict[str, torch.Tensor] = {}
    ordered = sorted(((spec.replica, rank, spec) for rank, specs in sources.items()
                      for spec in specs), key=lambda e: (e[0], e[1]))
    for replica, rank, spec in ordered:
        local = tensors[rank][spec.local_name]
        for p in spec.pieces:
            if p.name not in full:
                full[p.name] = torch.zeros(p.global_shape, dtype=torch.float64)
                count[p.name] = torch.zeros(p.global_shape, dtype=torch.int32)
            region = full[p.name][p.global_box.slices()]
            hits = count[p.name][p.global_box.slices()]
            values = local[p.local_box.slices()].double()
            if replica == 0:
                region.copy_(values)
                hits += 1
            else:  # a duplicate fills only what no replica-0 piece holds
                empty = hits == 0
                region[empty] = values[empty]
                hits[empty] = 1
    for name, c in count.items():
        if not bool((c == 1).all()):
            bad = int((c != 1).sum())
            counts = sorted(set(c.unique().tolist()) - {1})
            raise OracleError(f"{name}: {bad} elements are held by {counts} replica-0 sources "
                              "instead of exactly one")
    return full


def oracle_reshard(sources: Mapping[int, Sequence[ShardSpec]],
                   tensors: Mapping[int, Mapping[str, torch.Tensor]],
                   destinations: Mapping[int, Sequence[ShardSpec]],
                   ) -> dict[int, dict[str, torch.Tensor]]:
    """Returns what every destination tensor must hold after a correct reshard."""
    return shard_all(destinations, assemble(sources, tensors))


def first_difference(spec: ShardSpec, got: torch.Tensor, want: torch.Tensor) -> str:
    """Describes where `got` differs from `want`, in HF terms (parameter and region)."""
    if tuple(got.shape) != tuple(want.shape):
        return (f"{spec.local_name}: shape {tuple(got.shape)} differs from the expected "
                f"{tuple(want.shape)}")
    diff = got.double() != want.double()
    for piece in spec.pieces:
        region = diff[piece.local_box.slices()]
        if bool(region.any()):
            wrong = int(region.sum())
            index = [int(i) for i in region.nonzero()[0]]
            at = tuple(o + i for o, i in zip(piece.global_box.offsets, index))
            local_at = tuple(o + i for o, i in zip(piece.local_box.offsets, index))
            return (f"{piece.name} region {piece.global_box} (local {spec.local_name} "
                    f"{piece.local_box}): {wrong} of {piece.global_box.numel} elements wrong, "
                    f"first at global index {at}: got {got[local_at].item()}, expected "
                    f"{want[local_at].item()}")
    for box in spec.padding:
        if bool(diff[box.slices()].any()):
            return f"{spec.local_name}: padding region {box} was written"
    return ""
