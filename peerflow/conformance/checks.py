"""Check functions behind layers 1–2; each returns a list of problems (empty: pass).

Messages name the parameter and region, so a failing test points at what to fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from peerflow.conformance.harness import run_threaded
from peerflow.conformance.oracle import arange_globals, assemble, cut, first_difference, shard_all
from peerflow.layout import ParallelLayout
from peerflow.reshard import plan_reshard
from peerflow.shard import ShardSpec

Specs = Mapping[int, Sequence[ShardSpec]]


def layout_specs(adapter: type, config: object, layout: ParallelLayout,
                 rank_offset: int = 0) -> dict[int, list[ShardSpec]]:
    """Calls the adapter's `shard_layout` for every rank of `layout`.

    Ranks are `layout.global_ranks` shifted by `rank_offset`.
    """
    from peerflow.conformance.profile import AdapterProfile

    profile = AdapterProfile.of(adapter)
    layout = layout.with_ranks([r + rank_offset for r in range(layout.world_size)])
    return {rank: list(profile.shard_layout(config, layout, rank))
            for rank in layout.global_ranks}


def check_well_formed(specs: Specs, canonical: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Unique local names, known dtypes, canonical names and shapes, exact local tiling."""
    problems: list[str] = []
    for rank, items in sorted(specs.items()):
        seen: set[str] = set()
        for spec in items:
            where = f"rank {rank} tensor {spec.local_name!r}"
            if not isinstance(spec, ShardSpec):
                problems.append(f"rank {rank}: {spec!r} is not a ShardSpec")
                continue
            if spec.local_name in seen:
                problems.append(f"{where} is listed twice")
            seen.add(spec.local_name)
            if not isinstance(getattr(torch, spec.dtype, None), torch.dtype):
                problems.append(f"{where}: dtype {spec.dtype!r} is not a torch dtype name")
            for piece in spec.pieces:
                shape = canonical.get(piece.name)
                if shape is None:
                    problems.append(f"{where}: piece names {piece.name!r}, which is not a "
                                    "Hugging Face tensor of this model")
                elif tuple(shape) != piece.global_shape:
                    problems.append(f"{where}: {piece.name} has global shape "
                                    f"{piece.global_shape}, the HF model has {tuple(shape)}")
            cover = torch.zeros(spec.local_shape, dtype=torch.int32)
            for piece in spec.pieces:
                cover[piece.local_box.slices()] += 1
            for box in spec.padding:
                cover[box.slices()] += 1
            if cover.numel() and not bool((cover == 1).all()):
                twice, never = int((cover > 1).sum()), int((cover == 0).sum())
                problems.append(f"{where}: {twice} local elements described twice and "
                                f"{never} never (pieces plus padding must tile the tensor)")
    return problems


def check_coverage(specs: Specs, canonical: Mapping[str, tuple[int, ...]],
                   *, exactly_once: bool) -> list[str]:
    """Every HF element is held (by replica-0 pieces exactly once when `exactly_once`)."""
    counts = {n: torch.zeros(s, dtype=torch.int32) for n, s in canonical.items()}
    for items in specs.values():
        for spec in items:
            if exactly_once and spec.replica != 0:
                continue
            for piece in spec.pieces:
                if piece.name in counts and piece.global_shape == tuple(canonical[piece.name]):
                    counts[piece.name][piece.global_box.slices()] += 1
    problems = []
    for name, c in counts.items():
        missing = int((c == 0).sum())
        if missing:
            problems.append(f"{name}: {missing} of {c.numel()} elements are held by no "
                            f"{'replica-0 ' if exactly_once else ''}shard; extend a piece over "
                            "them (padding boxes may only cover rows holding no HF data)")
        if exactly_once and bool((c > 1).any()):
            problems.append(f"{name}: {int((c > 1).sum())} elements are held by several "
                            "replica-0 shards; mark duplicates with replica > 0")
    return problems


def check_replicas(specs: Specs, adapter: str = "the adapter") -> list[str]:
    """Data several ranks hold has one replica-0 holder; every other copy has `replica > 0`.

    Only replica 0 sends in a sync, so two replica-0 copies of one element make two
    senders: the planner refuses such a layout as a source (a `ShardError` in layer 2 or
    in the first sync back out of the engine). Both kinds of adapter must mark copies.
    """
    held: dict[str, list[tuple[int, ShardSpec, object]]] = {}
    for rank, items in sorted(specs.items()):
        for spec in items:
            if spec.replica == 0:
                for piece in spec.pieces:
                    held.setdefault(piece.name, []).append((rank, spec, piece.global_box))
    problems = []
    for name, holders in held.items():
        clash = next(((a, b) for i, a in enumerate(holders) for b in holders[i + 1:]
                      if a[0] != b[0] and a[2].intersect(b[2]) is not None), None)
        if clash is None:
            continue
        (rank_a, spec_a, box_a), (rank_b, spec_b, _) = clash
        problems.append(
            f"{name} {box_a}: ranks {rank_a} and {rank_b} both hold it as replica 0 "
            f"(local {spec_a.local_name!r} and {spec_b.local_name!r}); only one copy may "
            f"be replica 0. {adapter}.shard_layout must give every other copy `replica > "
            "0` — the dp rank for a full copy per dp replica: hf_layout(hf_config, "
            "RankCoords.of(layout, rank)) or vllm_layout(hf_config, RankCoords.of(layout, "
            "rank)), or ShardSpec.of_slice(…, replica=layout.coord(rank).dp) — and "
            "weight_targets()/weight_sources() must say the same")
    return problems


def compare(expected: Mapping[int, Mapping[str, torch.Tensor]],
            got: Mapping[int, Mapping[str, torch.Tensor]], specs: Specs,
            *, check_padding: bool = True) -> list[str]:
    """Compares destination tensors with the oracle's, element for element."""
    problems = []
    for rank, items in sorted(specs.items()):
        for spec in items:
            have = got.get(rank, {}).get(spec.local_name)
            if have is None:
                problems.append(f"rank {rank} tensor {spec.local_name!r} was never loaded")
                continue
            want = expected[rank][spec.local_name]
            have = have.detach().cpu()  # engines hold device tensors; the oracle is on the host
            if not check_padding:
                have = have.clone()
                for box in spec.padding:
                    have[box.slices()] = want[box.slices()]
            message = first_difference(spec, have, want)
            if message:
                problems.append(f"rank {rank}: {message}")
    return problems


def round_trip(src: Specs, dst: Specs, canonical: Mapping[str, tuple[int, ...]],
               *, bucket_bytes: int = 4096, device: str = "cpu") -> list[str]:
    """Reshards arange weights `src` → `dst` and back, checking both against the oracle.

    The real planner and executor (threads, one per rank) do the work; the oracle
    assembles full tensors naively and cuts the expected destination tensors.
    """
    full = arange_globals(canonical)
    src_tensors = shard_all(src, full)
    forward, _ = run_threaded(plan_reshard(src, dst), src_tensors, bucket_bytes=bucket_bytes,
                              device=device)
    forward = {r: {n: t.cpu() for n, t in ts.items()} for r, ts in forward.items()}
    problems = compare(shard_all(dst, assemble(src, src_tensors)), forward, dst)
    if problems:
        return problems
    backward, _ = run_threaded(plan_reshard(dst, src), forward, bucket_bytes=bucket_bytes,
                               device=device)
    backward = {r: {n: t.cpu() for n, t in ts.items()} for r, ts in backward.items()}
    return [f"back to the source layout: {p}" for p in compare(src_tensors, backward, src)]


def canonical_specs(canonical: Mapping[str, tuple[int, ...]], rank: int = 0) -> dict[int, list]:
    """One whole-tensor spec per HF name on `rank` (the canonical layout)."""
    return {rank: [ShardSpec.of_slice(n, s) for n, s in canonical.items()]}


def numel(canonical: Mapping[str, tuple[int, ...]]) -> int:
    """Total elements of a model."""
    return sum(math.prod(s) for s in canonical.values())


__all__ = ["canonical_specs", "check_coverage", "check_replicas", "check_well_formed",
           "compare", "cut", "layout_specs", "numel", "round_trip"]
