"""`RaggedField`: a packed ragged column, and the one offsets helper.

A ragged column stores every sample's rows back to back (`values`, `[total_len,
*trailing]`) with `offsets` (`[num_samples + 1]`, int64): sample `i` is
`values[offsets[i]:offsets[i+1]]`. Values and offsets live on one device. `Batch`
(`peerflow.batch`) holds ragged fields next to dense and object columns.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import torch


def offsets_from_lengths(lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """`[0, l0, l0 + l1, …]` (int64, `[len(lengths) + 1]`) on the lengths' device.

    The one offsets helper: every ragged layout in PeerFlow takes its offsets from here.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))


@attrs.frozen(kw_only=True)
class RaggedField:
    """A packed ragged column: sample `i` is `values[offsets[i]:offsets[i+1]]`."""

    values: torch.Tensor  # [total_len, *trailing]
    offsets: torch.Tensor  # [num_samples + 1], int64, on the values' device

    def __attrs_post_init__(self) -> None:
        if self.offsets.device != self.values.device:
            raise ValueError(
                f"RaggedField: values on {self.values.device} and offsets on "
                f"{self.offsets.device}; a ragged field lives on one device (build offsets "
                "with peerflow.batch.offsets_from_lengths from lengths on that device).")

    @property
    def device(self) -> torch.device:
        """Where the field's values and offsets live."""
        return self.values.device

    def to(self, device: torch.device | str) -> RaggedField:
        """The field with its values and offsets on `device` (itself when already there)."""
        device = torch.device(device)
        if self.values.device == device:
            return self
        return RaggedField(values=self.values.to(device), offsets=self.offsets.to(device))

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None):
        """Packs a list of per-sample tensors (first dimension ragged)."""
        tensors = [torch.as_tensor(t, dtype=dtype) for t in tensors]
        if not tensors:
            return cls(values=torch.empty(0, dtype=dtype or torch.float32),
                       offsets=torch.zeros(1, dtype=torch.int64))
        values = torch.cat([t.reshape(len(t), *t.shape[1:]) for t in tensors])
        lengths = torch.tensor([len(t) for t in tensors], dtype=torch.int64, device=values.device)
        return cls(values=values, offsets=offsets_from_lengths(lengths))

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[float]], dtype: torch.dtype) -> RaggedField:
        """Packs per-sample lists of numbers (one tensor built, no per-sample tensors)."""
        return cls(values=torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype),
                   offsets=offsets_from_lengths([len(row) for row in rows]))

    @property
    def lengths(self) -> torch.Tensor:  # [num_samples]
        """Per-sample lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, index: int) -> torch.Tensor:
        """Returns sample `index` as a view."""
        return self.values[int(self.offsets[index]) : int(self.offsets[index + 1])]

    def rows(self) -> list[torch.Tensor]:
        """Returns every sample as a view."""
        return list(torch.split(self.values, self.lengths.tolist()))

    def select(self, indices: Sequence[int] | torch.Tensor) -> RaggedField:
        """Returns the samples at `indices`, in that order (one gather, no per-sample loop)."""
        index = torch.as_tensor(indices, dtype=torch.int64, device=self.device)
        offsets, gather = self.gather_index(index)
        # index_select: cheaper than values[gather]
        return RaggedField(values=self.values.index_select(0, gather), offsets=offsets)

    def gather_index(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The offsets of the samples at `index` and the positions of their values.

        Fields with equal offsets share the result (`Batch.gather` computes it once).
        """
        lengths = self.lengths.index_select(0, index)
        offsets = offsets_from_lengths(lengths)
        total = int(offsets[-1])
        # Element j of the result comes from values[starts[s] + (j - offsets[s])] for the
        # selected sample s that j falls in.
        shift = torch.repeat_interleave(self.offsets.index_select(0, index) - offsets[:-1],
                                        lengths, output_size=total)
        return offsets, torch.arange(total, dtype=torch.int64, device=self.device).add_(shift)


def gather_rows(columns: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """The rows at each index (`None`: all rows) of each tensor, in one output tensor.

    Mixed dtypes promote as `torch.cat` would (an int64 field next to a float32 one
    becomes float32, never the reverse).
    """
    first = columns[0][0]
    dtype = functools.reduce(torch.promote_types, (c.dtype for c, _ in columns))
    sizes = [len(c) if i is None else len(i) for c, i in columns]
    out = first.new_empty((sum(sizes), *first.shape[1:]), dtype=dtype)
    start = 0
    for (column, index), size in zip(columns, sizes):
        if index is None:
            out[start : start + size].copy_(column)
        elif column.dtype == dtype:
            torch.index_select(column, 0, index, out=out[start : start + size])
        else:
            out[start : start + size].copy_(column.index_select(0, index))
        start += size
    return out


class RaggedGather:
    """Gathers ragged fields of `Batch.gather`'s parts; equal offsets share the work."""

    def __init__(self) -> None:
        self._known: list[tuple[list[torch.Tensor], Any]] = []  # (offsets per part, plan)

    def _plan(self, columns: Sequence[tuple[RaggedField, torch.Tensor | None]]) -> Any:
        offsets = [c.offsets for c, _ in columns]
        for known, plan in self._known:
            if all(a is b or torch.equal(a, b) for a, b in zip(known, offsets)):
                return plan
        indexed = [None if i is None else c.gather_index(i) for c, i in columns]
        lengths = [c.lengths if g is None else g[0].diff() for (c, _), g in zip(columns, indexed)]
        gathers = [None if g is None else g[1] for g in indexed]
        plan = (offsets_from_lengths(torch.cat(lengths)), gathers)
        self._known.append((offsets, plan))
        return plan

    def gather(self, columns: Sequence[tuple[RaggedField, torch.Tensor | None]]) -> RaggedField:
        """The samples at each part's index (`None`: all), as one ragged field."""
        offsets, gathers = self._plan(columns)
        values = gather_rows([(c.values, g) for (c, _), g in zip(columns, gathers)])
        return RaggedField(values=values, offsets=offsets)


