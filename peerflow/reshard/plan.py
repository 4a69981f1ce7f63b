"""`plan_reshard`: a pure function from shard metadata to a transfer plan.

Like `torch.distributed.checkpoint`'s `create_read_items_for_chunk_list`, planning only
intersects index boxes; no tensor is touched. Every rank that takes part in a sync
computes the same plan from the same inputs, so no rank needs to coordinate the others.

Checks (each error names the parameter and the region):

1. every HF name has one global shape in every spec that mentions it;
2. no element of a parameter is held by two `replica == 0` source pieces;
3. every element of every destination piece is covered by a source piece, and every
   element of a destination's local tensor is written exactly once (pieces and padding
   tile it);
4. every source element is read by some destination, unless its name matches `ignore`.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from peerflow.errors import ShardError
from peerflow.reshard.senders import assign_senders, cells, cuts, itemsize, route_piece
from peerflow.shard import Box, ShardPiece, ShardSpec

RankSpecs = Mapping[int, Sequence[ShardSpec]]


@attrs.frozen(kw_only=True)
class Transfer:
    """One rectangular copy from a source rank's tensor into a destination rank's tensor."""

    name: str
    """HF parameter the region belongs to."""
    src_rank: int
    """Global rank holding the source tensor."""
    src_tensor: str
    """Source local tensor name (`ShardSpec.local_name`)."""
    src_box: Box
    """Region inside the source local tensor."""
    dst_rank: int
    """Global rank holding the destination tensor."""
    dst_tensor: str
    """Destination local tensor name."""
    dst_box: Box
    """Region inside the destination local tensor (same sizes as `src_box`)."""
    wire_dtype: str
    """dtype name of the bytes on the wire: the narrower of the source's and the
    destination's floating dtypes (`wire_dtype`), so a float32 master copy travels as the
    bfloat16 its rollout holds, rounded once by the sender as the receiver would."""

    @property
    def numel(self) -> int:
        """Elements moved."""
        return self.src_box.numel


@attrs.frozen(kw_only=True)
class ReshardPlan:
    """A frozen transfer plan: which regions move from which rank to which rank.

    Identical on every rank that computed it from the same specs.
    """

    sources: Mapping[int, tuple[ShardSpec, ...]]
    """Source specs by global rank (all ranks, replicas included)."""
    destinations: Mapping[int, tuple[ShardSpec, ...]]
    """Destination specs by global rank."""
    transfers: tuple[Transfer, ...]
    """Every copy, grouped by destination tensor in destination order."""
    ignored: tuple[str, ...] = ()
    """HF names (or patterns) whose unused source elements were deliberately ignored."""

    def source_spec(self, rank: int, local_name: str) -> ShardSpec:
        """Returns the source spec `local_name` of `rank`."""
        return _by_name(self.sources, rank, local_name, "source")

    def destination_spec(self, rank: int, local_name: str) -> ShardSpec:
        """Returns the destination spec `local_name` of `rank`."""
        return _by_name(self.destinations, rank, local_name, "destination")

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank holding a source or a destination, sorted."""
        return tuple(sorted(set(self.sources) | set(self.destinations)))

    def sends_of(self, rank: int) -> tuple[Transfer, ...]:
        """Transfers `rank` sends (including to itself)."""
        return tuple(t for t in self.transfers if t.src_rank == rank)

    def receives_of(self, rank: int) -> tuple[Transfer, ...]:
        """Transfers `rank` receives (including from itself)."""
        return tuple(t for t in self.transfers if t.dst_rank == rank)

    @property
    def bytes(self) -> int:
        """Bytes moved by the whole plan (wire dtypes)."""
        return sum(t.numel * itemsize(t.wire_dtype) for t in self.transfers)

    def sender_bytes(self) -> dict[int, int]:
        """Bytes each source rank sends (its copies to itself included), by rank."""
        out: dict[int, int] = {}
        for t in self.transfers:
            out[t.src_rank] = out.get(t.src_rank, 0) + t.numel * itemsize(t.wire_dtype)
        return out

    @property
    def senders(self) -> int:
        """Source ranks that send any bytes."""
        return sum(1 for n in self.sender_bytes().values() if n)

    @property
    def sender_share(self) -> float:
        """The busiest sender's share of the plan's bytes (0.0 for an empty plan)."""
        per_rank = self.sender_bytes()
        total = sum(per_rank.values())
        return max(per_rank.values()) / total if total else 0.0

    def describe(self) -> str:
        """Returns a one-line summary (ranks, transfers, bytes)."""
        cross = sum(1 for t in self.transfers if t.src_rank != t.dst_rank)
        return (f"ReshardPlan: {len(self.sources)} source ranks -> {len(self.destinations)} "
                f"destination ranks, {len(self.transfers)} transfers ({cross} cross-rank), "
                f"{self.bytes / 2**20:.1f} MiB")


def _by_name(specs: Mapping[int, Sequence[ShardSpec]], rank: int, name: str,
             what: str) -> ShardSpec:
    for spec in specs.get(rank, ()):
        if spec.local_name == name:
            return spec
    raise KeyError(f"rank {rank} has no {what} tensor {name!r}")


def _as_rank_map(specs: RankSpecs | Sequence[ShardSpec], what: str) -> dict[int, tuple]:
    if isinstance(specs, Mapping):
        out = {int(rank): tuple(s) for rank, s in specs.items()}
    else:
        out = {0: tuple(specs)}
    for rank, items in out.items():
        seen: set[str] = set()
        for spec in items:
            if not isinstance(spec, ShardSpec):
                raise ShardError(f"{what} of rank {rank}: {spec!r} is not a ShardSpec.")
            if spec.local_name in seen:
                raise ShardError(
                    f"{what} of rank {rank} lists the local tensor {spec.local_name!r} twice; "
                    "give every local tensor one spec with all its pieces."
                )
            seen.add(spec.local_name)
    return out


def plan_reshard(
    sources: RankSpecs | Sequence[ShardSpec],
    destinations: RankSpecs | Sequence[ShardSpec],
    *,
    ignore: Iterable[str] = (),
    balance: bool = True,
) -> ReshardPlan:
    """Plans moving weights from source shards to destination shards.

    Args:
        sources: Source specs by global rank (a plain sequence means rank 0). A spec
            with `replica > 0` is a copy of elements a `replica == 0` piece may also
            hold (data-parallel replicas; a vLLM `qkv_proj` whose kv heads are
            replicated while its query rows are not).
        destinations: Destination specs by global rank (a plain sequence means rank 0).
        ignore: HF names or `fnmatch` patterns whose source elements may go unused (e.g.
            a trainer-only head the rollout engine does not hold).
        balance: Every holder of a region may send it, chosen to balance the bytes per
            sending rank (`peerflow.reshard.senders`): with replicated trainer ranks,
            each sends its share. `False`: replica 0 sends what it holds and a replica
            only what no replica 0 holds (reads the fewest sources; checkpoint export).

    Returns:
        The frozen plan.

    Raises:
        ShardError: shapes disagree, sources overlap, a destination region is not
            covered or written twice, or a source region is unused and not ignored; the
            message names the parameter, the ranks and tensors, and the region.
    """
    src = _as_rank_map(sources, "sources")
    dst = _as_rank_map(destinations, "destinations")
    ignore = tuple(ignore)
    src_pieces: dict[str, list[tuple[int, ShardSpec, ShardPiece]]] = {}
    backups: dict[str, list[tuple[int, ShardSpec, ShardPiece]]] = {}
    dst_pieces: dict[str, list[tuple[int, ShardSpec, ShardPiece]]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for table, side, index in ((src, "source", src_pieces), (dst, "destination", dst_pieces)):
        for rank, specs in sorted(table.items()):
            for spec in specs:
                if side == "destination":
                    _check_tiles(rank, spec)
                for piece in spec.pieces:
                    where = f"{side} rank {rank} tensor {spec.local_name!r}"
                    known = shapes.setdefault(piece.name, (piece.global_shape, where))
                    if known[0] != piece.global_shape:
                        raise ShardError(
                            f"{piece.name}: {where} says its global shape is "
                            f"{piece.global_shape}, but {known[1]} says {known[0]}; both sides "
                            "must describe the same model."
                        )
                    if piece.global_box.numel == 0:
                        continue
                    if side == "source" and spec.replica != 0:
                        backups.setdefault(piece.name, []).append((rank, spec, piece))
                        continue
                    index.setdefault(piece.name, []).append((rank, spec, piece))
    for entries in backups.values():
        entries.sort(key=lambda e: (e[1].replica, e[0]))
    for name in sorted(set(src_pieces) | set(dst_pieces)):
        _check_coverage(name, shapes[name][0], src_pieces.get(name, []),
                        dst_pieces.get(name, []), backups.get(name, []), ignore)
    routed = [(rank, spec, piece, cell, who)
              for rank, specs in sorted(dst.items()) for spec in specs for piece in spec.pieces
              for cell, who in route_piece(piece.global_box, rank,
                                           src_pieces.get(piece.name, ()),
                                           backups.get(piece.name, ()), balance=balance)]
    chosen = assign_senders([(cell, who) for *_, cell, who in routed])
    transfers = [_transfer(cell, *sender, rank, spec, piece)
                 for (rank, spec, piece, cell, _), sender in zip(routed, chosen, strict=True)]
    return ReshardPlan(sources=src, destinations=dst, transfers=tuple(transfers), ignored=ignore)


def _transfer(box: Box, s_rank: int, s_spec: ShardSpec, s_piece: ShardPiece, d_rank: int,
              d_spec: ShardSpec, d_piece: ShardPiece) -> Transfer:
    return Transfer(name=d_piece.name, src_rank=s_rank, src_tensor=s_spec.local_name,
                    src_box=_to_local(box, s_piece), dst_rank=d_rank,
                    dst_tensor=d_spec.local_name, dst_box=_to_local(box, d_piece),
                    wire_dtype=wire_dtype(s_spec.dtype, d_spec.dtype))


def wire_dtype(src: str, dst: str) -> str:
    """The dtype a region travels in: `dst` when it is a narrower float than `src`.

    The cast to the destination's dtype happens anyway; done by the sender, it halves the
    bytes of a float32 → bfloat16 sync and rounds the same (`Tensor.copy_`, round to
    nearest even). Anything else (a wider destination, integers) travels as the source.
    """
    import torch

    s, d = getattr(torch, src), getattr(torch, dst)
    return dst if s.is_floating_point and d.is_floating_point and d.itemsize < s.itemsize \
        else src


def _gaps(box: Box, covering: Sequence[Box], extra: Sequence[Box] = ()) -> list[Box]:
    """Cells of `box` no `covering` box touches (cut also along `extra` boxes' edges)."""
    clipped = [c for b in covering if (c := box.intersect(b)) is not None]
    if sum(c.numel for c in clipped) == box.numel:
        return []
    extra = [c for b in extra if (c := box.intersect(b)) is not None]
    return [cell for cell in cells(cuts(box.ends, clipped + extra + [box]))
            if cell.numel and cell.intersect(box) == cell and
            not any(cell.intersect(c) for c in clipped)]


def _to_local(box: Box, piece: ShardPiece) -> Box:
    delta = [lo - g for lo, g in zip(piece.local_box.offsets, piece.global_box.offsets)]
    return box.shift(delta)


def _check_tiles(rank: int, spec: ShardSpec) -> None:
    """Pieces and padding of a destination tensor cover it exactly once."""
    boxes = [(p.local_box, f"piece of {p.name}") for p in spec.pieces]
    boxes += [(b, "padding") for b in spec.padding]
    for (a, what_a), (b, what_b) in itertools.combinations(boxes, 2):
        common = a.intersect(b)
        if common is not None:
            raise ShardError(
                f"destination rank {rank} tensor {spec.local_name!r}: local region {common} is "
                f"written twice ({what_a} and {what_b}); pieces and padding must not overlap."
            )
    covered = sum(b.numel for b, _ in boxes)
    if covered != math.prod(spec.local_shape):
        cells = _uncovered(spec.local_shape, [b for b, _ in boxes])
        raise ShardError(
            f"destination rank {rank} tensor {spec.local_name!r}: local region {cells[0]} "
            f"(of {len(cells)} such regions) is neither a piece nor padding; describe every "
            "element of the local tensor."
        )


def _uncovered(shape: Sequence[int], boxes: Sequence[Box]) -> list[Box]:
    return [cell for cell in cells(cuts(shape, boxes))
            if cell.numel and not any(cell.intersect(b) for b in boxes)]


def _check_coverage(name: str, shape: tuple[int, ...], srcs: list, dsts: list,
                    backups: list, ignore: tuple[str, ...]) -> None:
    """Checks sources do not overlap, cover destinations, and are all used."""
    for (ra, sa, pa), (rb, sb, pb) in itertools.combinations(srcs, 2):
        common = pa.global_box.intersect(pb.global_box)
        if common is not None:
            raise ShardError(
                f"{name}: region {common} is held by two replica-0 sources (rank {ra} tensor "
                f"{sa.local_name!r} and rank {rb} tensor {sb.local_name!r}); mark all but one "
                "holder with replica > 0."
            )
    if not srcs and not backups and dsts:
        rank, spec, _ = dsts[0]
        raise ShardError(
            f"{name}: destination rank {rank} tensor {spec.local_name!r} needs it, but no "
            "source holds any of it; add it to the sources."
        )
    boxes = [p.global_box for _, _, p in srcs]
    spare = [p.global_box for _, _, p in backups]
    for rank, spec, piece in dsts:
        gaps = _gaps(piece.global_box, boxes, spare)
        missing = [cell for cell in gaps if not any(b.intersect(cell) == cell for b in spare)]
        if missing:
            raise ShardError(
                f"{name}: region {missing[0]} needed by destination rank {rank} tensor "
                f"{spec.local_name!r} is held by no source "
                f"({len(missing)} uncovered region(s)); the sources do not cover the parameter."
            )
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore) or not srcs:
        return
    wanted = [p.global_box for _, _, p in dsts]
    if any(b.numel == math.prod(shape) for b in wanted):
        return
    for rank, spec, piece in srcs:
        unused = _gaps(piece.global_box, wanted)
        if unused:
            raise ShardError(
                f"{name}: region {unused[0]} of source rank {rank} tensor {spec.local_name!r} "
                "is read by no destination; add a destination for it or pass "
                f"ignore=[{name!r}] to plan_reshard."
            )
