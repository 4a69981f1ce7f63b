"""Deadlines for a weight sync: no exchange waits for a peer forever.

Every wait of a transport goes through `peerflow.distributed.comm.wait_all` with
`PeerWork` triples and the transport's deadline (`WeightTransport.deadline_s`: its
`timeout`, else `default_timeout()`, i.e. `runtime.fault_timeout`), and the executor
wraps each bucket's exchange in `exchange_bucket`, so a peer that stops answering ends
the sync with a `WorkerFailedError` naming this rank, the silent rank(s), the bucket and
the transport.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from peerflow.errors import WorkerFailedError


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
