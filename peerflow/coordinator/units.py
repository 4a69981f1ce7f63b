"""What `redistribute`'s plans assign and what a call reports: units, token loads, stats.

Shared by the two-round p2p path, the one-round shared-memory path
(`coordinator.shared_p2p`) and the centralized baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from peerflow.batch import Batch
from peerflow.coordinator.transfer import TransferPlan

#: Ragged fields whose lengths make up a sample's token load.
LOAD_FIELDS: tuple[str, ...] = ("prompt_ids", "response_ids")

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


def plan_slack(keep_groups: bool) -> float:
    """The plan's locality slack (`plan_transfer`): 0 for single samples.

    A re-balance of samples exists to even the load, and a moved sample costs a few
    kilobytes, so it keeps samples home only where that costs no balance.
    """
    return 0.05 if keep_groups else 0.0


def sample_units(batch: Batch, keep_groups: bool) -> torch.Tensor:
    """The id of each sample's unit of assignment: its prompt group, or itself."""
    return batch.group_id if keep_groups else batch.sample_id


def sample_loads(batch: Batch, load_fields: Sequence[str], keep_groups: bool) -> torch.Tensor:
    """Each sample's token load; balancing samples, 0 where `train_mask` drops it."""
    loads = batch.token_count(load_fields)
    if not keep_groups and "train_mask" in batch:
        loads = loads * batch["train_mask"].to(torch.bool)
    return loads


def assemble(parts: Sequence[tuple[Batch, Sequence[int] | None]]) -> Batch:
    """`Batch.gather` of `(batch, indices)` parts (`None`: all of it), in one copy per field.

    A plan lists each sender's indices distinct and in order, so indices covering every
    sample mean the whole batch; a single whole part is returned as is (no copy).
    """
    parts = [(b, None if i is None or len(i) == len(b) else i) for b, i in parts]
    if len(parts) == 1 and parts[0][1] is None:
        return parts[0][0]
    return Batch.gather(parts)
