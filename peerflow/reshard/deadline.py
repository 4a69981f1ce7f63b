"""Deadlines for a weight sync: no exchange waits for a peer forever.

Every wait of a transport goes through `wait_peers` with the transport's deadline
(`WeightTransport.deadline_s`: its `timeout`, else `peerflow.distributed.comm.
default_timeout()`, i.e. `runtime.fault_timeout`), and the executor wraps each bucket's
exchange in `exchange_bucket`, so a peer that stops answering ends the sync with a
`WorkerFailedError` naming this rank, the silent rank(s), the bucket and the transport.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from peerflow.distributed.comm import peer_failure
from peerflow.errors import WorkerFailedError

#: One wait of an exchange: (peer rank, what is awaited, e.g. "receive", async work handle).
PeerWork = tuple[int, str, Any]


def wait_peers(works: Sequence[PeerWork], *, rank: int, transport: str,
               timeout: float) -> None:
    """Waits for every handle, all within `timeout` seconds from now.

    Raises:
        WorkerFailedError: a handle failed or was not done in time; names this rank, the
            transport and every peer whose handle was still pending.
    """
    deadline = time.monotonic() + timeout
    for index, (peer, what, work) in enumerate(works):
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except Exception as exc:
            pending = sorted({p for p, _, w in works[index:] if not _done(w)} | {peer})
            cause = peer_failure()
            raise WorkerFailedError(
                f"rank {rank}, weight transport {transport!r}: rank(s) {pending} did not "
                f"answer within {timeout:g} s (waiting to {what} rank {peer}: "
                f"{type(exc).__name__}: {exc})" + (f"; {cause}" if cause else "")
            ) from exc


def _done(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return False


def exchange_bucket(transport: Any, index: int, sends: Mapping[int, torch.Tensor],
                    recvs: Mapping[int, int], routes: Sequence[tuple[int, int, int]]
                    ) -> dict[int, torch.Tensor]:
    """`transport.exchange` of bucket `index`; a failure names the bucket and the ranks.

    Raises:
        WorkerFailedError: the exchange failed or timed out (the message says which bucket,
            which transport, this rank and the peers it exchanges with).
    """
    try:
        return transport.exchange(sends, recvs, routes)
    except WorkerFailedError as exc:
        raise WorkerFailedError(f"weight sync bucket {index}: {exc}") from exc
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        peers = sorted(set(sends) | set(recvs))
        raise WorkerFailedError(
            f"weight sync bucket {index}: rank {transport.rank}, weight transport "
            f"{transport.name!r}, exchanging with rank(s) {peers}: {type(exc).__name__}: {exc}"
        ) from exc
