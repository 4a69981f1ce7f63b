"""Building blocks shared by every layout builder: splits, stage ranges, fused stacks.

Conventions every builder follows:

* Canonical tensors are Hugging Face checkpoint names and shapes, experts one by one
  (`model.layers.{L}.mlp.experts.{e}.gate_proj.weight`); see `hf_parameters`.
* A local tensor that packs several HF tensors along a new leading dimension (packed MoE
  experts `[E, 2I, H]`) is described by its 2-D view with the leading dimensions merged
  (`[E * 2I, H]`); adapters `view` the tensor accordingly. `ShardPiece` boxes copy regions
  without reshaping, so every piece's global and local boxes have the same rank.
* Parameters held identically by several ranks (norms, replicated biases, routers, the
  second copy of tied embeddings) get `replica > 0` everywhere but on one rank, so only
  one rank sends them during a sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from peerflow.errors import ConfigError
from peerflow.shard import Box, ShardPiece, ShardSpec


def split_even(total: int, parts: int, rank: int, *, what: str, dim: str = "tp") -> range:
    """Returns the indices rank `rank` owns when `total` items split evenly over `parts`.

    Raises:
        ConfigError: `parts` does not divide `total` (names `what` and the valid degrees).
    """
    if total % parts:
        divisors = [d for d in range(1, total + 1) if total % d == 0]
        raise ConfigError(
            f"{dim}={parts} does not divide the model's {total} {what}; choose {dim} from "
            f"{divisors}."
        )
    if not 0 <= rank < parts:
        raise ConfigError(f"{dim} rank {rank} is outside 0..{parts - 1}.")
    size = total // parts
    return range(rank * size, (rank + 1) * size)


def split_chunk(total: int, parts: int, rank: int) -> range:
    """Returns rank `rank`'s rows under `torch.chunk` semantics (FSDP2, DTensor `Shard(0)`).

    Every rank but the last ones gets `ceil(total / parts)` rows; trailing ranks may get
    fewer or none.
    """
    chunk = -(-total // parts)
    start = min(rank * chunk, total)
    return range(start, min(start + chunk, total))


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Returns the global layer indices of pipeline stage `pp_rank`.

    Layers split evenly; when `pp_size` does not divide `num_layers`, the first
    `num_layers % pp_size` stages own one extra layer. Engines with another rule (vLLM's
    `get_pp_indices`) pass their own range to the builders' `layers` argument.
    """
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp rank {pp_rank} is outside 0..{pp_size - 1}.")
    if pp_size > num_layers:
        raise ConfigError(
            f"pp={pp_size} exceeds the model's {num_layers} layers; use pp <= {num_layers}."
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


@attrs.frozen(kw_only=True)
class Segment:
    """A box of one HF tensor placed next in a fused local tensor (along dim 0)."""

    name: str
    """HF parameter name."""
    global_shape: tuple[int, ...] = attrs.field(converter=tuple)
    """Shape of the full HF tensor."""
    box: Box
    """The region of the HF tensor."""


def rows_of(name: str, shape: Sequence[int], rows: range, cols: range | None = None) -> Segment:
    """Returns the segment of rows `rows` (and columns `cols`, default all) of an HF tensor."""
    shape = tuple(shape)
    offsets = [rows.start] + [0] * (len(shape) - 1)
    sizes = [len(rows)] + list(shape[1:])
    if cols is not None:
        offsets[1], sizes[1] = cols.start, len(cols)
    return Segment(name=name, global_shape=shape, box=Box(offsets=offsets, sizes=sizes))


def stack(
    local_name: str,
    segments: Sequence[Segment],
    *,
    dtype: str,
    replica: int = 0,
    pad_rows: int = 0,
) -> ShardSpec:
    """Returns the spec of a local tensor made of `segments` concatenated along dim 0.

    Args:
        local_name: The engine's name for the tensor.
        segments: HF regions in local order; all share their trailing sizes. Empty
            segments (a vocab shard made only of padding) are dropped.
        dtype: torch dtype name of the local tensor.
        replica: Replica index (0 sends).
        pad_rows: Rows of padding after the last segment (vocab padding).
    """
    trailing = segments[0].box.sizes[1:]
    pieces, cursor = [], 0
    for seg in segments:
        if seg.box.numel == 0:
            continue
        if seg.box.sizes[1:] != trailing:
            raise ConfigError(
                f"{local_name}: segment of {seg.name} has trailing sizes {seg.box.sizes[1:]}, "
                f"expected {trailing}; fused segments must agree past dim 0."
            )
        local = Box(offsets=(cursor,) + (0,) * len(trailing), sizes=seg.box.sizes)
        pieces.append(
            ShardPiece(name=seg.name, global_shape=seg.global_shape, global_box=seg.box,
                       local_box=local)
        )
        cursor += seg.box.sizes[0]
    padding = ()
    if pad_rows:
        padding = (Box(offsets=(cursor,) + (0,) * len(trailing), sizes=(pad_rows, *trailing)),)
    return ShardSpec(
        local_name=local_name,
        local_shape=(cursor + pad_rows, *trailing),
        pieces=tuple(pieces),
        dtype=dtype,
        padding=padding,
        replica=replica,
    )


def whole(name: str, shape: Sequence[int], *, dtype: str, replica: int = 0,
          local_name: str | None = None) -> ShardSpec:
    """Returns the spec of a local tensor holding the whole HF tensor `name`."""
    return ShardSpec.of_slice(name, tuple(shape), local_name=local_name, dtype=dtype,
                              replica=replica)


def restrict_rows(spec: ShardSpec, rows: range, *, local_name: str | None = None) -> ShardSpec:
    """Returns the spec of rows `rows` of the local tensor `spec` describes.

    Used for dim-0 shards (FSDP2) of any tensor whose full form has a spec: pieces are
    clipped to the rows and shifted to start at local row 0; padding is clipped too.
    """
    trailing = spec.local_shape[1:]
    window = Box(offsets=(rows.start,) + (0,) * len(trailing), sizes=(len(rows), *trailing))
    shift = (-rows.start,) + (0,) * len(trailing)
    pieces = []
    for piece in spec.pieces:
        common = piece.local_box.intersect(window) if len(rows) else None
        if common is None:
            continue
        delta = [g - lo for g, lo in zip(piece.global_box.offsets, piece.local_box.offsets)]
        pieces.append(
            ShardPiece(
                name=piece.name,
                global_shape=piece.global_shape,
                global_box=common.shift(delta),
                local_box=common.shift(shift),
            )
        )
    padding = []
    for box in spec.padding:
        common = box.intersect(window) if len(rows) else None
        if common is not None:
            padding.append(common.shift(shift))
    return ShardSpec(
        local_name=local_name or spec.local_name,
        local_shape=(len(rows), *trailing),
        pieces=tuple(pieces),
        dtype=spec.dtype,
        padding=tuple(padding),
        replica=spec.replica,
    )


def replica_index(copy: int, copies: int, dp_rank: int) -> int:
    """Returns a replica index unique among all holders: 0 only for copy 0 on dp-rank 0.

    Args:
        copy: Which of the `copies` identical holders inside one dp replica (e.g. tp rank
            for a tp-replicated norm; 0 for a tp-split tensor).
        copies: How many identical holders one dp replica has.
        dp_rank: Data-parallel replica index.
    """
    return dp_rank * copies + copy


@attrs.frozen(kw_only=True)
class RankCoords:
    """Where one rank sits in a `tp × pp × ep × dp` mesh: what every layout builder reads.

    `RankCoords.of(layout, rank)` takes them from a `ParallelLayout`; tests and benches
    build one directly (`RankCoords(tp_rank=1, tp_size=2)`).
    """

    tp_rank: int = 0
    """Tensor-parallel rank."""
    tp_size: int = 1
    """Tensor-parallel size (must divide heads, kv heads and MLP width)."""
    pp_rank: int = 0
    """Pipeline stage."""
    pp_size: int = 1
    """Pipeline stages."""
    layers: range | None = None
    """Global layers of this stage (e.g. vLLM's `get_pp_indices` range when pp does not
    divide the layers); default `stage_layers(…)`."""
    ep_rank: int = 0
    """Expert-parallel rank (MoE)."""
    ep_size: int = 1
    """Expert-parallel size; experts split in contiguous blocks."""
    expert_tp_size: int | None = None
    """How many ranks split each expert's width (the expert tp rank is
    `tp_rank % expert_tp_size`); default: the builder's."""
    expert_replica: int | None = None
    """Replica index of this rank's expert tensors. Default: with `ep_size == 1` derived
    from the tp copies and `dp_rank`; with `ep_size > 1` 0 (every ep rank holds distinct
    experts; pass the expert-data-parallel index when experts are replicated too)."""
    dp_rank: int = 0
    """Data-parallel replica (only for replica indices)."""

    @classmethod
    def of(cls, layout: Any, rank: int) -> RankCoords:
        """Returns the tp/pp/dp coordinates of global rank `rank` of a `ParallelLayout`."""
        coord = layout.coord(rank)
        return cls(tp_rank=coord.tp, tp_size=layout.tp, pp_rank=coord.pp, pp_size=layout.pp,
                   dp_rank=coord.dp)

    @property
    def tp_replica(self) -> int:
        """Replica index of a tensor every tp rank holds whole (norms, routers)."""
        return replica_index(self.tp_rank, self.tp_size, self.dp_rank)

    @property
    def own_replica(self) -> int:
        """Replica index of this rank's own shard of a tp-split tensor."""
        return replica_index(0, 1, self.dp_rank)

    def stage(self, shape: Any) -> range:
        """Returns the global layers of this rank's pipeline stage."""
        if self.layers is not None:
            return self.layers
        return stage_layers(shape.num_layers, self.pp_rank, self.pp_size)

    def expert_split(self, shape: Any, default_tp: int) -> tuple[range, range, int]:
        """Returns (experts held, expert MLP channels held, replica index of expert tensors).

        Args:
            shape: The MoE model's `ModelShape`.
            default_tp: Expert tp size when `expert_tp_size` is not set.
        """
        etp = self.expert_tp_size or default_tp
        rep = self.expert_replica
        if rep is None:
            rep = replica_index(self.tp_rank // etp, self.tp_size // etp, self.dp_rank) \
                if self.ep_size == 1 else 0
        experts = split_even(shape.num_experts, self.ep_size, self.ep_rank, what="experts",
                             dim="ep")
        width = split_even(shape.moe_intermediate_size, etp, self.tp_rank % etp,
                           what="expert MLP channels", dim="expert tp")
        return experts, width, rep


#: One rank holding everything: the builders' default.
ONE_RANK = RankCoords()
