"""Collectives and point-to-point exchanges that never wait forever.

Every helper takes a `timeout` in seconds (default: the process group's, i.e.
`runtime.fault_timeout`) and raises `WorkerFailedError` naming what it waited for; a
published peer failure takes precedence (the peer is named, not this rank).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from peerflow.distributed.failure import read_failure
from peerflow.distributed.fault_scope import current_monitor
from peerflow.errors import WorkerFailedError
from peerflow.wirecodec import decode, encode


def default_timeout() -> float:
    """The timeout `init_distributed` configured (60 s when unknown)."""
    from peerflow.distributed.init import dist_context

    ctx = dist_context()
    return ctx.timeout if ctx is not None else 60.0


def peer_failure() -> str | None:
    """The failure a peer published to the failure monitor, if any (named in timeouts)."""
    monitor = current_monitor()
    if monitor is None:
        return None
    try:
        record = read_failure(monitor.store)
    except Exception:
        return None
    return record.message() if record is not None and record.rank != monitor.rank else None


#: One awaited handle of a point-to-point exchange: (peer rank, what this rank awaits
#: from it, e.g. "receive a bucket header from", the async work handle).
PeerWork = tuple[int, str, Any]


def wait_all(works: Sequence[Any], what: str, timeout: float | None = None) -> None:
    """Waits for async work handles, each for at most `timeout` seconds.

    Args:
        works: Work handles, or `PeerWork` triples (point-to-point exchanges): a timeout
            then names every peer whose handle is still pending.
        what: What is awaited, for the error (`"rank 0, weight transport 'torch'"`).
        timeout: Seconds per handle (default: `default_timeout()`).

    Raises:
        WorkerFailedError: a handle failed or timed out (naming `what`, the silent peers
            and, when one is published, the peer that failed).
    """
    timeout = default_timeout() if timeout is None else timeout
    delta = datetime.timedelta(seconds=timeout)
    for index, item in enumerate(works):
        peer, action, work = item if isinstance(item, tuple) else (None, "", item)
        try:
            work.wait(timeout=delta)
        except Exception as exc:
            published = peer_failure()
            cause = f"; {published}" if published else ""
            if peer is None:
                message = f"{what} did not complete within {timeout:g} s ({exc})"
            else:
                pending = sorted({p for p, _, w in works[index:] if not _done(w)} | {peer})
                message = (f"{what}: rank(s) {pending} did not answer within {timeout:g} s "
                           f"(waiting to {action} rank {peer}: {type(exc).__name__}: {exc})")
            raise WorkerFailedError(message + cause) from exc


def _done(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return False


def all_gather_tensor(tensor: torch.Tensor, group: Any = None, *, what: str = "all_gather",
                      timeout: float | None = None) -> list[torch.Tensor]:
    """All-gathers equally shaped tensors with a timeout."""
    size = dist.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(size)]
    wait_all([dist.all_gather(out, tensor, group=group, async_op=True)], what, timeout)
    return out


def all_gather_ragged(rows: torch.Tensor, group: Any = None, *, what: str = "all_gather",
                      timeout: float | None = None) -> list[torch.Tensor]:
    """All-gathers `[n_i, k]` tensors whose first dimension differs per rank.

    Two collectives: the row counts, then the rows padded to the largest count. The
    counts travel beside the rows, on their device, so any group that carries the rows
    carries them.
    """
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    counts = [int(c) for c in all_gather_tensor(count, group, what=f"{what} (counts)",
                                                 timeout=timeout)]
    padded = rows.new_zeros((max(counts + [0]), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = all_gather_tensor(padded, group, what=what, timeout=timeout)
    return [g[:c] for g, c in zip(gathered, counts)]


def all_gather_values(value: Any, group: Any = None, *, what: str = "all_gather",
                      timeout: float | None = None) -> list[Any]:
    """Every rank's `value`, in group rank order: `all_gather_object` without pickle.

    `value` holds plain values and `peerflow.wirecodec`'s types; it travels encoded, as
    host `uint8` rows (`all_gather_ragged`), and each rank decodes the others' bytes with
    the codec, so nothing a peer sends runs (a malformed one raises `WireFormatError`).
    """
    data = torch.frombuffer(bytearray(encode(value)), dtype=torch.uint8)
    rows = all_gather_ragged(data, group, what=what, timeout=timeout)
    return [decode(row.numpy().tobytes(), what=f"{what} (group rank {i})")
            for i, row in enumerate(rows)]


def barrier(group: Any = None, *, what: str = "barrier", timeout: float | None = None) -> None:
    """A barrier with a timeout (an all-reduce of one host element, over the group's gloo)."""
    one = torch.ones(1)
    wait_all([dist.all_reduce(one, group=group, async_op=True)], what, timeout)


def store_wait(store: Any, keys: dict[str, int], what: str, timeout: float | None = None) -> None:
    """Waits until every key of a c10d store exists (one round trip when they do).

    Args:
        store: A `torch.distributed.Store`.
        keys: Key → the rank that sets it (named when it is missing).
        what: Names the wait in the error.
        timeout: Seconds to wait.

    Raises:
        WorkerFailedError: a key was not set within `timeout` (naming the ranks whose keys
            are missing and, when one is published, the peer that failed).
    """
    timeout = default_timeout() if timeout is None else timeout
    if not keys:
        return
    try:
        store.wait(list(keys), datetime.timedelta(seconds=timeout))
    except Exception as exc:
        try:
            missing = sorted({rank for key, rank in keys.items() if not store.check([key])})
        except Exception:  # the store itself is gone (its host rank died)
            missing = []
        whom = f"rank(s) {missing}" if missing else "a peer (the store is unreachable)"
        peer = peer_failure()
        cause = f"; {peer}" if peer else ""
        raise WorkerFailedError(
            f"{what}: {whom} did not answer within {timeout:g} s ({exc}){cause}"
        ) from exc
