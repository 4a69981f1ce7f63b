"""Parallel layouts: which ranks a worker group has and how they form a mesh."""

from __future__ import annotations

import attrs

from peerflow.errors import ConfigError

#: Mesh dimensions from slowest- to fastest-varying rank index (tp peers are adjacent
#: ranks, as in Megatron-core and torchtitan, so tp traffic stays inside a node).
MESH_ORDER = ("pp", "dp", "ep", "cp", "tp")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ConfigError(f"ParallelLayout.{attribute.name}={value}: must be at least 1.")


@attrs.frozen(kw_only=True)
class MeshCoord:
    """Where one rank sits in a `ParallelLayout` mesh."""

    dp: int
    tp: int
    pp: int
    ep: int = 0
    cp: int = 0


@attrs.frozen(kw_only=True)
class ParallelLayout:
    """The ranks of one worker group and their `pp × dp × ep × cp × tp` mesh.

    Data is consumed per dp-rank: all tp/pp/cp/ep peers that share a dp coordinate see
    the same samples. `ranks` are global ranks; by default the group starts at rank 0.
    """

    dp: int = attrs.field(default=1, validator=_positive)
    """Data-parallel degree: how many disjoint sample streams the group consumes."""
    tp: int = attrs.field(default=1, validator=_positive)
    """Tensor-parallel degree."""
    pp: int = attrs.field(default=1, validator=_positive)
    """Pipeline-parallel degree (stages own contiguous layer ranges)."""
    ep: int = attrs.field(default=1, validator=_positive)
    """Expert-parallel degree (MoE experts split across ranks)."""
    cp: int = attrs.field(default=1, validator=_positive)
    """Context-parallel degree (sequence split across ranks)."""
    ranks: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    """Global ranks of the group, in mesh order; empty means `range(world_size)`."""

    def __attrs_post_init__(self) -> None:
        if self.ranks and len(self.ranks) != self.world_size:
            raise ConfigError(
                f"ParallelLayout has {len(self.ranks)} ranks but dp*tp*pp*ep*cp = "
                f"{self.world_size}; give exactly that many ranks or change the degrees."
            )
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"ParallelLayout ranks {self.ranks} repeat a rank.")

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self.dp * self.tp * self.pp * self.ep * self.cp

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The group's global ranks (explicit or `0 … world_size-1`)."""
        return self.ranks or tuple(range(self.world_size))

    def with_ranks(self, ranks: tuple[int, ...] | list[int]) -> ParallelLayout:
        """Returns the same mesh placed on other global ranks."""
        return attrs.evolve(self, ranks=tuple(ranks))

    def _sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    def coord(self, rank: int) -> MeshCoord:
        """Returns the mesh coordinate of a global rank of this group.

        Raises:
            ValueError: `rank` is not in the group.
        """
        try:
            local = self.global_ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in layout ranks {self.global_ranks}") from None
        coord: dict[str, int] = {}
        for name in reversed(MESH_ORDER):
            size = getattr(self, name)
            coord[name] = local % size
            local //= size
        return MeshCoord(**coord)

    def rank_at(self, **coord: int) -> int:
        """Returns the global rank at a mesh coordinate (missing dimensions are 0)."""
        local = 0
        for name in MESH_ORDER:
            local = local * getattr(self, name) + coord.get(name, 0)
        return self.global_ranks[local]

    def dp_rank(self, rank: int) -> int:
        """Returns the data-parallel index of a global rank."""
        return self.coord(rank).dp

    def ranks_of_dp(self, dp_rank: int) -> tuple[int, ...]:
        """Returns every global rank (tp/pp/ep/cp peers) that consumes `dp_rank`'s data."""
        return tuple(r for r in self.global_ranks if self.coord(r).dp == dp_rank)

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Returns the rank groups along one mesh dimension (e.g. every tp group)."""
        if dim not in MESH_ORDER:
            raise ValueError(f"unknown mesh dimension {dim!r}; expected one of {MESH_ORDER}")
        buckets: dict[tuple[int, ...], list[int]] = {}
        for rank in self.global_ranks:
            coord = attrs.asdict(self.coord(rank))
            key = tuple(v for k, v in coord.items() if k != dim)
            buckets.setdefault(key, []).append(rank)
        return [tuple(g) for g in buckets.values()]

    def describe(self) -> str:
        """Returns a short human form such as `dp2×tp2 @ ranks 0-3`."""
        dims = "×".join(f"{n}{s}" for n, s in self._sizes().items() if s > 1) or "dp1"
        ranks = self.global_ranks
        contiguous = list(ranks) == list(range(ranks[0], ranks[0] + len(ranks)))
        where = f"{ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 1 else str(list(ranks))
        return f"{dims} @ ranks {where}"

    def check_divides(self, what: str, count: int, dim: str = "tp") -> None:
        """Raises `ConfigError` unless `count` (heads, layers, experts) splits over `dim`.

        Args:
            what: What is being split, for the message (e.g. "attention heads").
            count: How many of them the model has.
            dim: The mesh dimension that splits them.
        """
        size = getattr(self, dim)
        if count % size:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise ConfigError(
                f"{dim}={size} does not divide the model's {count} {what}; "
                f"choose {dim} from {divisors}."
            )
