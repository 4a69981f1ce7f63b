"""What `redistribute`'s plans assign and what a call reports: units, token loads, stats.

Shared by the two-round p2p path, the one-round shared-memory path
(`coordinator.shared_p2p`) and the centralized baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.coordinator.transfer import TransferPlan

#: Ragged fields whose lengths make up a sample's token load.
LOAD_FIELDS: tuple[str, ...] = ("prompt_ids", "response_ids")
#: The ragged field the samples of one prompt group have in common.
PROMPT_FIELD = "prompt_ids"

DATA_TAG = 73
"""Tag of the payload messages (every mode); `exchange` sends tails on the next tag."""


@attrs.define(eq=False)
class TransferStats:
    """What one rank sent and received in one `redistribute` call."""

    bytes_sent: int = 0
    """Bytes this rank sent to other processes (local copies excluded)."""
    bytes_received: int = 0
    """Bytes this rank received from other processes."""
    metadata_bytes: int = 0
    """Metadata bytes this rank sent and received."""
    samples_in: int = 0
    """Samples this rank held as a producer."""
    samples_out: int = 0
    """Samples this rank holds as a consumer afterwards."""
    wall_s: float = 0.0
    """Seconds spent in the call."""
    cpu_s: float = 0.0
    """CPU seconds of the calling thread in the call (`time.thread_time`; gloo's own
    threads not counted): the call's wall on a machine with a core per process."""
    plan: TransferPlan | None = None
    """The plan it executed (p2p mode; `None` on a rank that mapped the batch another
    rank assembled for it (`shared_p2p.assemblers`), and on ranks that only produce over
    shm)."""
    transport: str = ""
    """The transport its exchanges used (`gloo` or `shm`)."""

    @property
    def bytes_total(self) -> int:
        """Bytes through this rank's network interface (sent + received + metadata)."""
        return self.bytes_sent + self.bytes_received + self.metadata_bytes


@attrs.frozen(kw_only=True)
class Balance:
    """What a route's plan balances: its units, their token loads and its locality slack."""

    fields: tuple[str, ...] = attrs.field(default=LOAD_FIELDS, converter=tuple)
    """Ragged fields whose summed lengths make up a sample's load."""
    keep_groups: bool = True
    """Keep prompt groups whole (`False`: a re-balance of single samples before training,
    where a sample whose `train_mask` is false weighs 0)."""
    shared_prompts: bool = False
    """The consumers run a prompt once for all its samples in a row
    (`CausalLMTrainEngine.shares_prompts`). Sharing pays only for samples kept together,
    so groups stay whole even where `keep_groups` is false, each weighing what its row
    costs: its prompt once (spread over its samples, `prompt_shares`) and every answer."""

    @property
    def by_group(self) -> bool:
        """Whether the units are prompt groups (else single samples)."""
        return self.keep_groups or self.shared_prompts

    @property
    def slack(self) -> float:
        """The plan's locality slack (`plan_transfer`): 0 for a re-balance.

        A re-balance before training exists to even the load, and a moved sample costs a
        few kilobytes, so it keeps samples (or groups) home only where that costs no
        balance.
        """
        return 0.05 if self.keep_groups else 0.0

    def units(self, batch: Batch) -> torch.Tensor:
        """The id of each sample's unit of assignment: its prompt group, or itself."""
        return batch.group_id if self.by_group else batch.sample_id

    def loads(self, batch: Batch) -> torch.Tensor:
        """Each sample's token load (0 where a re-balance's `train_mask` drops it)."""
        keep = None
        if not self.keep_groups and "train_mask" in batch:
            keep = batch["train_mask"].to(torch.bool)
        if not (self.shared_prompts and PROMPT_FIELD in self.fields
                and isinstance(batch.fields.get(PROMPT_FIELD), RaggedField)):
            loads = batch.token_count(self.fields)
        else:
            rest = batch.token_count([f for f in self.fields if f != PROMPT_FIELD])
            loads = rest + prompt_shares(batch, keep)
        return loads if keep is None else loads * keep


def prompt_shares(batch: Batch, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Each sample's share of its group's prompt tokens (the shares of a group sum to them).

    The group's prompt length is split evenly over its samples in `batch` that `keep`
    (all by default), the remainder going to the first of them; a sample not kept gets 0.
    """
    prompt = batch.lengths(PROMPT_FIELD)
    kept = torch.ones(len(batch), dtype=torch.bool) if keep is None else keep
    ids, group = torch.unique(batch.group_id, return_inverse=True)
    count = torch.zeros(len(ids), dtype=torch.int64).index_add_(0, group, kept.to(torch.int64))
    members = count[group].clamp(min=1)
    shares = torch.where(kept, prompt // members, 0)
    first = torch.full_like(count, len(batch)).scatter_reduce(
        0, group[kept], torch.arange(len(batch))[kept], "amin")
    leads = first[first < len(batch)]
    shares[leads] += prompt[leads] % members[leads]
    return shares


def assemble(parts: Sequence[tuple[Batch, Sequence[int] | None]]) -> Batch:
    """`Batch.gather` of `(batch, indices)` parts (`None`: all of it), in one copy per field.

    A plan lists each sender's indices distinct and in order, so indices covering every
    sample mean the whole batch; a single whole part is returned as is (no copy).
    """
    parts = [(b, None if i is None or len(i) == len(b) else i) for b, i in parts]
    if len(parts) == 1 and parts[0][1] is None:
        return parts[0][0]
    return Batch.gather(parts)
