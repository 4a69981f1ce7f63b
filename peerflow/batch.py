"""`Batch`: a columnar, ragged container of samples that travels as a few flat tensors.

Every sample has a globally unique `sample_id`, a `group_id` (the n answers to one prompt
share it) and the `weight_version` of the policy that produced it. Fields are named
columns of three kinds:

* ragged tensors, packed as `values` (`[total_len, *trailing]`) plus `offsets`
  (`[num_samples + 1]`), e.g. `response_ids`, `logprobs`;
* dense tensors with one row per sample (`[num_samples, *trailing]`), e.g. `reward`;
* Python objects, one per sample (strings, dicts), e.g. the ground-truth `answer`.

Fields the runtime does not know travel untouched: nothing in PeerFlow keeps a fixed
schema that could silently drop a column.

Every tensor of a batch (ids, values, offsets) lives on one device, `Batch.device`; a
tensor on another device is an error naming its field. Batches live on the host: the
worker, coordinator, streaming and estimators only see host batches, and `to_wire`
refuses anything else. The training toolkit alone moves a micro-batch to its engine's
device, whole (`Batch.to`), and brings results back (docs/architecture.md, "Where
tensors live").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from peerflow.ragged import RaggedField, RaggedGather, gather_rows, offsets_from_lengths

__all__ = ["LOSS_MASK", "Batch", "Column", "RaggedField", "offsets_from_lengths"]

#: Ragged bool field aligned with `response_ids`: true on tokens the model sampled
#: (absent: every response token is trained). See `Batch.loss_mask`.
LOSS_MASK = "loss_mask"


def _device_error(name: str, tensor: torch.Tensor, device: torch.device) -> ValueError:
    return ValueError(
        f"Batch field {name!r} is on {tensor.device} but the batch lives on {device}: every "
        "tensor of a batch lives on one device, and batches live on the host (docs/"
        "architecture.md, 'Where tensors live'). Bring engine results back to the host "
        "where they leave the engine; only the training toolkit moves a whole micro-batch "
        "to its device (Batch.to)."
    )


Column = RaggedField | torch.Tensor | list


@attrs.define(eq=False)
class Batch:
    """A ragged batch of samples with global identities and named fields."""

    sample_id: torch.Tensor  # [num_samples], int64, globally unique
    group_id: torch.Tensor  # [num_samples], int64, shared by the answers to one prompt
    weight_version: torch.Tensor  # [num_samples], int64, policy version that produced it
    fields: dict[str, Column] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.sample_id = torch.as_tensor(self.sample_id, dtype=torch.int64)
        self.group_id = torch.as_tensor(self.group_id, dtype=torch.int64)
        self.weight_version = torch.as_tensor(self.weight_version, dtype=torch.int64)
        n = len(self.sample_id)
        if len(self.group_id) != n or len(self.weight_version) != n:
            raise ValueError(
                f"Batch ids disagree: {n} sample_id, {len(self.group_id)} group_id, "
                f"{len(self.weight_version)} weight_version."
            )
        for name in ("group_id", "weight_version"):
            if getattr(self, name).device != self.device:
                raise _device_error(name, getattr(self, name), self.device)
        for name, column in self.fields.items():
            self._check_column(name, column)

    @property
    def device(self) -> torch.device:
        """Where every tensor of the batch lives (the host, but inside the training toolkit)."""
        return self.sample_id.device

    def _check_column(self, name: str, column: Column) -> None:
        if not isinstance(column, RaggedField | torch.Tensor | list):
            raise TypeError(
                f"Batch field {name!r} is a {type(column).__name__}; use a RaggedField, a "
                "tensor with one row per sample, or a list with one object per sample."
            )
        tensor = column.values if isinstance(column, RaggedField) else column
        if isinstance(tensor, torch.Tensor) and tensor.device != self.device:
            raise _device_error(name, tensor, self.device)
        if len(column) != len(self):
            raise ValueError(
                f"Batch field {name!r} has {len(column)} samples but the batch has {len(self)}."
            )

    def to(self, device: torch.device | str) -> Batch:
        """The batch with every tensor (ids, values, offsets) on `device`.

        The training toolkit's crossing (`CausalLMTrainEngine.build_micro_batch`); the
        batch itself when it is already there.
        """
        device = torch.device(device)
        if device == self.device:
            return self
        fields = {name: column.to(device) if isinstance(column, RaggedField | torch.Tensor)
                  else column for name, column in self.fields.items()}
        return Batch(sample_id=self.sample_id.to(device), group_id=self.group_id.to(device),
                     weight_version=self.weight_version.to(device), fields=fields)

    @classmethod
    def empty(cls) -> Batch:
        """Returns a batch with no samples and no fields."""
        zero = torch.zeros(0, dtype=torch.int64)
        return cls(sample_id=zero, group_id=zero, weight_version=zero)

    def __len__(self) -> int:
        return len(self.sample_id)

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def __getitem__(self, name: str) -> Column:
        try:
            return self.fields[name]
        except KeyError:
            raise KeyError(
                f"Batch has no field {name!r}; it has {sorted(self.fields)}. A workflow node "
                "that produces it must run before the node that reads it."
            ) from None

    def set(self, name: str, column: Column | Sequence[torch.Tensor]) -> Batch:
        """Adds or replaces a field in place and returns the batch.

        A list of tensors is packed as a ragged field; use `set_objects` for other lists.
        """
        if isinstance(column, list | tuple) and column and all(
            isinstance(c, torch.Tensor) for c in column
        ):
            column = RaggedField.from_tensors(column)
        self._check_column(name, column)
        self.fields[name] = column
        return self

    def set_objects(self, name: str, objects: Iterable[Any]) -> Batch:
        """Adds or replaces a per-sample Python-object field (strings, dicts)."""
        objects = list(objects)
        self._check_column(name, objects)
        self.fields[name] = objects
        return self

    def ragged(self, name: str) -> RaggedField:
        """Returns a ragged field, raising a clear error if it is of another kind."""
        column = self[name]
        if not isinstance(column, RaggedField):
            raise TypeError(f"Batch field {name!r} is not ragged ({type(column).__name__}).")
        return column

    def lengths(self, name: str) -> torch.Tensor:  # [num_samples]
        """Per-sample lengths of a ragged field."""
        return self.ragged(name).lengths

    def loss_mask(self) -> torch.Tensor | None:  # [response tokens] bool
        """Which response tokens are trained: the `loss_mask` field's flat values.

        `loss_mask` (ragged bool, aligned with `response_ids`) is false on tokens the model
        did not sample (a multi-turn trajectory's observation tokens); absent, every
        response token is trained and this returns `None`.

        Raises:
            ValueError: `loss_mask` is not aligned with `response_ids`.
        """
        if LOSS_MASK not in self.fields:
            return None
        mask, expected = self.ragged(LOSS_MASK), self.lengths("response_ids")
        if not torch.equal(mask.lengths, expected):
            bad = int((mask.lengths != expected).nonzero()[0, 0])
            raise ValueError(
                f"batch field 'loss_mask' is not aligned with 'response_ids': sample {bad} has "
                f"{int(mask.lengths[bad])} values for {int(expected[bad])} response tokens; "
                "the rollout must emit one flag per response token (true: sampled by the "
                "model, false: an observation)."
            )
        return mask.values.to(torch.bool)

    def trained_lengths(self) -> torch.Tensor:  # [num_samples] int64
        """Per-sample count of trained response tokens (all of them without `loss_mask`)."""
        lengths = self.lengths("response_ids")
        mask = self.loss_mask()
        if mask is None:
            return lengths
        sample = torch.repeat_interleave(torch.arange(len(lengths), device=self.device), lengths)
        counts = torch.zeros(len(lengths), dtype=torch.int64, device=self.device)
        return counts.index_add(0, sample, mask.long())

    def to_padded(
        self, name: str, pad_value: float | int = 0, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns a ragged field right-padded to `[num_samples, length]` and its mask.

        Args:
            name: Ragged field to pad.
            pad_value: Value for positions past a sample's end.
            length: Padded length; defaults to the longest sample.

        Returns:
            `(padded, mask)` where `mask` is `True` on real positions.
        """
        field = self.ragged(name)
        lengths = field.lengths
        length = int(lengths.max()) if length is None and len(lengths) else (length or 0)
        padded = field.values.new_full((len(self), length, *field.values.shape[1:]), pad_value)
        mask = torch.arange(length, device=self.device)[None, :] < lengths[:, None]
        padded[mask] = field.values
        return padded, mask

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """Returns a new batch with the samples at `indices`, in that order."""
        return Batch.gather([(self, indices)])

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Concatenates batches that share the same field names.

        Raises:
            ValueError: The batches have different fields (naming the difference).
        """
        return cls.gather([(b, None) for b in batches])

    @classmethod
    def gather(cls, parts: Sequence[tuple[Batch, Sequence[int] | torch.Tensor | None]]) -> Batch:
        """`concat` of each `batch.select(indices)` (`None`: all of it), one copy per field.

        Every field's rows are gathered straight into one output tensor: no per-part
        intermediate batch. Ragged fields with equal offsets share one gather index per part.

        Raises:
            ValueError: The batches have different fields (naming the difference).
        """
        rows = [(b, None if i is None else torch.as_tensor(i, dtype=torch.int64, device=b.device))
                for b, i in parts]
        rows = [(b, i) for b, i in rows if (len(b) if i is None else len(i))] or rows[:1]
        if not rows:
            return cls.empty()
        devices = {b.device for b, _ in rows}
        if len(devices) > 1:
            raise ValueError(f"cannot gather batches that live on {sorted(map(str, devices))}; "
                             "batches live on the host (docs/architecture.md).")
        names = list(rows[0][0].fields)
        for b, _ in rows[1:]:
            if set(b.fields) != set(names):
                raise ValueError(
                    f"cannot concatenate batches with fields {sorted(names)} and "
                    f"{sorted(b.fields)}; every producer must emit the same fields."
                )
        ragged = RaggedGather()
        fields: dict[str, Column] = {}
        for name in names:
            columns = [(b.fields[name], i) for b, i in rows]
            if isinstance(columns[0][0], RaggedField):
                fields[name] = ragged.gather(columns)
            elif isinstance(columns[0][0], torch.Tensor):
                fields[name] = gather_rows(columns)
            else:
                fields[name] = [obj for c, i in columns
                                for obj in (c if i is None else [c[j] for j in i.tolist()])]
        return cls(sample_id=gather_rows([(b.sample_id, i) for b, i in rows]),
                   group_id=gather_rows([(b.group_id, i) for b, i in rows]),
                   weight_version=gather_rows([(b.weight_version, i) for b, i in rows]),
                   fields=fields)

    def token_count(self, names: Sequence[str] = ("prompt_ids", "response_ids")) -> torch.Tensor:
        """Per-sample token load: the summed lengths of the named ragged fields present."""
        total = torch.zeros(len(self), dtype=torch.int64, device=self.device)
        for name in names:
            if isinstance(self.fields.get(name), RaggedField):
                total += self.fields[name].lengths
        return total

    def to_wire(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Flattens the batch into a small metadata dict and a list of contiguous tensors.

        Python-object fields travel inside the metadata, which the transport encodes with
        `peerflow.wirecodec` (plain values and its type table; never a pickle).
        `Batch.from_wire(*batch.to_wire())` reproduces the batch exactly.

        Raises:
            ValueError: the batch is not on the host (batches cross processes from there).
        """
        if self.device.type != "cpu":
            raise ValueError(
                f"Batch.to_wire: the batch lives on {self.device}; batches travel between "
                "processes from the host (docs/architecture.md, 'Where tensors live').")
        tensors = [self.sample_id, self.group_id, self.weight_version]
        layout: list[tuple[str, str]] = []
        objects: dict[str, list] = {}
        for name, column in self.fields.items():
            if isinstance(column, RaggedField):
                layout.append((name, "ragged"))
                tensors += [column.values, column.offsets]
            elif isinstance(column, torch.Tensor):
                layout.append((name, "dense"))
                tensors.append(column)
            else:
                layout.append((name, "objects"))
                objects[name] = column
        meta = {"layout": layout, "objects": objects}
        return meta, [t.contiguous() for t in tensors]

    @classmethod
    def from_wire(cls, meta: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> Batch:
        """Rebuilds a batch from `to_wire`'s output."""
        it = iter(tensors)
        sample_id, group_id, weight_version = next(it), next(it), next(it)
        fields: dict[str, Column] = {}
        for name, kind in meta["layout"]:
            if kind == "ragged":
                fields[name] = RaggedField(values=next(it), offsets=next(it))
            elif kind == "dense":
                fields[name] = next(it)
            else:
                fields[name] = list(meta["objects"][name])
        return cls(sample_id=sample_id, group_id=group_id, weight_version=weight_version,
                   fields=fields)
