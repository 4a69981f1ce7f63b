"""`ShardSpec`: how a local tensor maps onto Hugging Face tensors.

The canonical wire format is Hugging Face parameter names and logical shapes (q/k/v and
gate/up separate, experts one by one). An engine describes every local tensor it holds as
a `ShardSpec`: the local tensor's name and shape plus one `ShardPiece` per rectangular
region it holds of some HF tensor. A plain tensor-parallel shard is one piece; a vLLM
`qkv_proj` shard is three pieces (its slices of q, k and v); Megatron's interleaved QKV is
three pieces per query group. Regions of the local tensor that hold no HF data (vocab
padding) are listed in `padding` so every local element is accounted for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from peerflow.errors import ShardError


def _int_tuple(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class Box:
    """An axis-aligned box of tensor indices: `offsets[d] <= i_d < offsets[d] + sizes[d]`."""

    offsets: tuple[int, ...] = attrs.field(converter=_int_tuple)
    """Start index along every dimension."""
    sizes: tuple[int, ...] = attrs.field(converter=_int_tuple)
    """Extent along every dimension (0 makes an empty box)."""

    def __attrs_post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ShardError(f"Box offsets {self.offsets} and sizes {self.sizes} differ in rank.")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ShardError(f"Box {self} has a negative offset or size.")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """Returns the box covering a whole tensor of `shape`."""
        return cls(offsets=(0,) * len(shape), sizes=tuple(shape))

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.sizes)

    @property
    def numel(self) -> int:
        """Number of elements inside the box."""
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        """Exclusive end index along every dimension."""
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def slices(self) -> tuple[slice, ...]:
        """Returns slices that select the box from a tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        """Returns the common sub-box, or `None` when the boxes do not overlap."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        return Box(offsets=starts, sizes=tuple(e - s for s, e in zip(starts, ends)))

    def shift(self, delta: Sequence[int]) -> Box:
        """Returns the box translated by `delta` (may be negative)."""
        return Box(offsets=tuple(o + d for o, d in zip(self.offsets, delta)), sizes=self.sizes)

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside a tensor of `shape`."""
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.ends, shape))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{e}" for o, e in zip(self.offsets, self.ends)) + "]"


@attrs.frozen(kw_only=True)
class ShardPiece:
    """One rectangular region of a Hugging Face tensor held inside a local tensor."""

    name: str
    """Hugging Face parameter name, e.g. `model.layers.0.self_attn.q_proj.weight`."""
    global_shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    """Logical shape of the full HF tensor."""
    global_box: Box
    """The region of the HF tensor this piece holds."""
    local_box: Box
    """Where that region sits in the local tensor (same sizes as `global_box`)."""

    def __attrs_post_init__(self) -> None:
        if self.global_box.sizes != self.local_box.sizes:
            raise ShardError(
                f"{self.name}: global box {self.global_box} and local box {self.local_box} "
                "have different sizes; a piece copies a region without reshaping it."
            )
        if not self.global_box.within(self.global_shape):
            raise ShardError(
                f"{self.name}: box {self.global_box} lies outside the global shape "
                f"{self.global_shape}."
            )


@attrs.frozen(kw_only=True)
class ShardSpec:
    """Describes one local tensor as pieces of Hugging Face tensors.

    Sources (a trainer's shards) and destinations (a rollout engine's parameters) use the
    same type, so a resharding plan is a pure function of two lists of specs.
    """

    local_name: str
    """The engine's own name for the tensor (e.g. vLLM's `…qkv_proj.weight`)."""
    local_shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    """Shape of the local tensor."""
    pieces: tuple[ShardPiece, ...] = attrs.field(converter=tuple)
    """The HF regions the tensor holds; several for fused parameters."""
    dtype: str = "float32"
    """torch dtype name of the local tensor (`float32`, `bfloat16`, …)."""
    padding: tuple[Box, ...] = attrs.field(default=(), converter=tuple)
    """Local regions that hold no HF data (e.g. vocab padding); deliberately ignored."""
    replica: int = 0
    """Replica index among ranks holding identical data (dp or tp replicas of norms).
    Replica 0 is the one copy a checkpoint export reads; a weight sync shares the
    sending among every replica (`peerflow.reshard.senders`)."""

    def __attrs_post_init__(self) -> None:
        for piece in self.pieces:
            if not piece.local_box.within(self.local_shape):
                raise ShardError(
                    f"{self.local_name}: piece of {piece.name} at local box {piece.local_box} "
                    f"lies outside the local shape {self.local_shape}."
                )
        for box in self.padding:
            if not box.within(self.local_shape):
                raise ShardError(
                    f"{self.local_name}: padding box {box} lies outside the local shape "
                    f"{self.local_shape}."
                )

    @classmethod
    def of_slice(
        cls,
        name: str,
        global_shape: Sequence[int],
        box: Box | None = None,
        *,
        local_name: str | None = None,
        dtype: str = "float32",
        replica: int = 0,
    ) -> ShardSpec:
        """Returns the spec of a local tensor that is exactly one box of one HF tensor.

        Args:
            name: HF parameter name.
            global_shape: Shape of the full HF tensor.
            box: Region held; `None` means the whole tensor.
            local_name: Engine name of the local tensor; defaults to `name`.
            dtype: torch dtype name of the local tensor.
            replica: Replica index (0 sends).
        """
        box = box or Box.full(global_shape)
        piece = ShardPiece(
            name=name,
            global_shape=tuple(global_shape),
            global_box=box,
            local_box=Box(offsets=(0,) * box.ndim, sizes=box.sizes),
        )
        return cls(
            local_name=local_name or name,
            local_shape=box.sizes,
            pieces=(piece,),
            dtype=dtype,
            replica=replica,
        )

    @property
    def names(self) -> tuple[str, ...]:
        """HF names this local tensor holds pieces of, in piece order, without repeats."""
        return tuple(dict.fromkeys(p.name for p in self.pieces))

    @property
    def numel(self) -> int:
        """Elements of the local tensor."""
        return math.prod(self.local_shape)
