"""A deterministic, resumable prompt sampler: every dp-rank reads its own shard.

The task's examples form one global *stream*. A dataset whose size the task reports
(`Task.size`, with `Task.example` for direct access) is replayed epoch after epoch, each
epoch in its own seeded permutation. Otherwise the examples are read in the task's order
(an endless generator stays in order; a finite one discovered to end is replayed with
seeded permutations from its second epoch on).
dp-rank `r` of `D` owns stream positions `r, r + D, r + 2D, …` (interleaved, like
`torch.utils.data.DistributedSampler`), so no rank ever reads another's prompts and rank 0
has no special role. The sampler's whole state is one cursor per rank: saving it in a
checkpoint and restoring it replays exactly the same prompts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import attrs
import torch

from peerflow.algorithms.base import Example
from peerflow.errors import ConfigError


@attrs.frozen(kw_only=True)
class Draw:
    """One prompt handed to this rank."""

    position: int
    """Global stream position; unique over the run, used as the prompt's `group_id`."""
    example: Example
    """The task example at that position."""


@attrs.define(eq=False)
class ShardedPromptSampler:
    """Reads this dp-rank's share of a task's example stream.

    Args:
        examples: Zero-argument callable returning a fresh iterator over the task's
            examples in a deterministic order (`lambda: task.examples("train", seed)`).
        dp_rank: This rank's data-parallel index.
        dp_size: Number of data-parallel ranks reading the stream.
        seed: Seed of the per-epoch permutations of a finite dataset.
        scan_limit: How many examples to read looking for the end of the dataset; a
            stream longer than this is treated as endless (generated tasks).
    """

    examples: Callable[[], Iterator[Example]]
    dp_rank: int
    dp_size: int
    seed: int = 0
    scan_limit: int = 1_000_000
    size: int | None = None
    """Dataset size when the task knows it (`Task.size`); with `lookup`, no scan is needed."""
    lookup: Callable[[int], Example] | None = None
    """Direct access to example `i` (`Task.example`), used together with `size`."""
    cursor: int = 0
    """How many draws this rank has made (its position in its own shard)."""
    _cache: list[Example] = attrs.field(factory=list, init=False)
    _iterator: Iterator[Example] | None = attrs.field(default=None, init=False)
    _size: int | None = attrs.field(default=None, init=False)
    _perms: dict[int, torch.Tensor] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size:
            raise ConfigError(
                f"ShardedPromptSampler: dp_rank={self.dp_rank} is outside 0..{self.dp_size - 1}."
            )

    def _fill(self, upto: int) -> None:
        """Reads the stream until `upto` examples are cached or it ends."""
        if self._size is not None:
            return
        if self._iterator is None:
            self._iterator = iter(self.examples())
        need = min(upto, self.scan_limit) - len(self._cache)
        if need > 0:
            self._cache.extend(itertools.islice(self._iterator, need))
            if len(self._cache) < min(upto, self.scan_limit):
                self._size = len(self._cache)
                if self._size == 0:
                    raise ConfigError(
                        "the task yielded no training examples; check task.options (dataset "
                        "path, split, filters)."
                    )

    def _stream(self, position: int) -> Example:
        if self.size is not None and self.lookup is not None:
            if self.size <= 0:
                raise ConfigError(
                    "the task has no training examples; check task.options (dataset path, "
                    "split, filters)."
                )
            epoch, offset = divmod(position, self.size)
            return self.lookup(int(self._perm(epoch, self.size)[offset]))
        self._fill(position + 1)
        if self._size is None:
            if position >= self.scan_limit:
                raise ConfigError(
                    f"prompt stream position {position} is past scan_limit={self.scan_limit}; "
                    "raise the limit or shorten the run."
                )
            return self._cache[position]
        epoch, offset = divmod(position, self._size)
        if epoch == 0:
            return self._cache[offset]
        return self._cache[int(self._perm(epoch, self._size)[offset])]

    def _perm(self, epoch: int, size: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = self._perms[epoch] = torch.randperm(size, generator=gen)
            self._perms.pop(epoch - 2, None)
        return perm

    def draw(self, count: int) -> list[Draw]:
        """Returns this rank's next `count` prompts and advances the cursor."""
        out = []
        for _ in range(count):
            position = self.cursor * self.dp_size + self.dp_rank
            out.append(Draw(position=position, example=self._stream(position)))
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """Returns what a checkpoint must keep to resume the same prompt sequence."""
        return {"cursor": self.cursor, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores `state_dict()` output.

        Raises:
            ConfigError: the checkpoint was written with another dp size or seed.
        """
        if state.get("dp_size") != self.dp_size or state.get("seed") != self.seed:
            raise ConfigError(
                f"checkpoint sampler state was written with dp_size={state.get('dp_size')}, "
                f"seed={state.get('seed')} but this run has dp_size={self.dp_size}, "
                f"seed={self.seed}; resume with the same nprocs and seed."
            )
        self.cursor = int(state["cursor"])


def split_evenly(total: int, parts: int, index: int) -> int:
    """Returns how many of `total` items part `index` of `parts` gets (first ones get more)."""
    return total // parts + (1 if index < total % parts else 0)
