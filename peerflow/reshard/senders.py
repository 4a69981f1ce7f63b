"""Who sends each destination region: every source replica shares the work.

A region several source ranks hold (data-parallel replicas of a trainer, the
tensor-parallel copies of a norm) could come from any of them. `route_piece` cuts a
destination piece into cells, each with the sources holding it whole; `assign_senders`
then picks one holder per cell so the bytes per sending rank come out balanced, the
same way on every rank (no coordination: the inputs are the gathered specs):

* a holder on the destination's own rank wins (a local copy crosses no link);
* a cell several ranks hold and of at least `2 * MIN_SLAB_BYTES` is cut into row
  slabs, one per holder, so even one large tensor is sent by every replica;
* the remaining choices go largest first to the least-loaded holder (ties: lowest
  replica, then lowest rank) — longest-processing-time scheduling, within 4/3 of the
  best balance.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence

from peerflow.shard import Box, ShardPiece, ShardSpec

#: A source piece and where it lives: (global rank, its spec, the piece).
Entry = tuple[int, ShardSpec, ShardPiece]

#: Smallest slab a shared cell is cut into (bytes); smaller cells go to one holder whole.
MIN_SLAB_BYTES = 1 << 20


@functools.cache
def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name."""
    import torch

    return getattr(torch, dtype).itemsize


def cuts(shape: Sequence[int], boxes: Iterable[Box]) -> list[list[int]]:
    """Sorted cut points along every dimension: 0, the shape, and every box edge."""
    out = [{0, n} for n in shape]
    for box in boxes:
        for d, (o, e) in enumerate(zip(box.offsets, box.ends)):
            out[d].update((o, e))
    return [sorted(c) for c in out]


def cells(cut_points: list[list[int]]) -> Iterable[Box]:
    """Every box of the grid the cut points make."""
    spans = [list(zip(c[:-1], c[1:])) for c in cut_points]
    for combo in itertools.product(*spans):
        yield Box(offsets=[a for a, _ in combo], sizes=[b - a for a, b in combo])


def _contains(outer: Box, inner: Box) -> bool:
    return outer.intersect(inner) == inner


def _order(entry: Entry) -> tuple[int, int]:
    return entry[1].replica, entry[0]


def route_piece(box: Box, dst_rank: int, primary: Sequence[Entry],
                backups: Sequence[Entry], *, balance: bool) -> list[tuple[Box, list[Entry]]]:
    """Cuts a destination box into cells, each with the sources that may send it.

    Args:
        box: The destination piece's global box.
        dst_rank: The destination's rank (a holder there is taken alone).
        primary: `replica == 0` source pieces of the parameter (they never overlap).
        backups: `replica > 0` source pieces, lowest replica then rank first.
        balance: Share cells among every holder; `False`: replica 0 sends what it
            holds and a replica only what no replica 0 holds (the fewest sources read).

    Returns:
        `(cell, holders)` pairs tiling `box`; one holder means no choice. The planner's
        coverage check has made sure every cell has a holder.
    """
    mine = [e for e in primary if e[2].global_box.intersect(box) is not None]
    spare = [e for e in backups if e[2].global_box.intersect(box) is not None]
    if not balance or not spare:
        out = [(box.intersect(e[2].global_box), [e]) for e in mine]
        if sum(c.numel for c, _ in out) == box.numel:
            return out
        return out + [(cell, [next(e for e in spare if _contains(e[2].global_box, cell))])
                      for cell in _uncovered(box, [c for c, _ in out], spare)]
    holders = sorted(mine + spare, key=_order)
    clipped = [box.intersect(e[2].global_box) for e in holders]
    out = []
    for cell in cells(cuts(box.ends, clipped + [box])):
        if not cell.numel or not _contains(box, cell):
            continue
        who = [e for e, c in zip(holders, clipped) if _contains(c, cell)]
        local = [e for e in who if e[0] == dst_rank]
        if local:
            out.append((cell, local[:1]))
            continue
        out.extend((slab, who) for slab in _slabs(cell, len(who), itemsize(who[0][1].dtype)))
    return out


def _uncovered(box: Box, covered: Sequence[Box], spare: Sequence[Entry]) -> list[Box]:
    """Cells of `box` outside `covered`, cut along the spare holders' edges too."""
    extra = [c for e in spare if (c := box.intersect(e[2].global_box)) is not None]
    return [cell for cell in cells(cuts(box.ends, list(covered) + extra + [box]))
            if cell.numel and _contains(box, cell)
            and not any(cell.intersect(c) for c in covered)]


def _slabs(cell: Box, holders: int, item: int) -> list[Box]:
    """`cell` cut into up to `holders` row slabs of at least `MIN_SLAB_BYTES` each."""
    if cell.ndim == 0 or holders < 2:
        return [cell]
    rows = cell.sizes[0]
    count = min(holders, rows, cell.numel * item // MIN_SLAB_BYTES)
    if count < 2:
        return [cell]
    edges = [cell.offsets[0] + rows * i // count for i in range(count + 1)]
    return [Box(offsets=(a, *cell.offsets[1:]), sizes=(b - a, *cell.sizes[1:]))
            for a, b in zip(edges[:-1], edges[1:])]


def assign_senders(choices: Sequence[tuple[Box, Sequence[Entry]]]) -> list[Entry]:
    """Picks one holder per cell, balancing bytes per sending rank (deterministic).

    Cells with one holder load it first; the rest go largest first (ties: plan order)
    to the holder with the fewest bytes so far (ties: lowest replica, then rank).
    """
    load: dict[int, int] = {}
    out: list[Entry | None] = [None] * len(choices)

    def size(i: int) -> int:
        cell, who = choices[i]
        return cell.numel * itemsize(who[0][1].dtype)

    for i, (_, who) in enumerate(choices):
        if len(who) == 1:
            out[i] = who[0]
            load[who[0][0]] = load.get(who[0][0], 0) + size(i)
    shared = sorted((i for i, (_, who) in enumerate(choices) if len(who) > 1),
                    key=lambda i: (-size(i), i))
    for i in shared:
        pick = min(choices[i][1], key=lambda e: (load.get(e[0], 0), *_order(e)))
        out[i] = pick
        load[pick[0]] = load.get(pick[0], 0) + size(i)
    return out  # type: ignore[return-value]
