"""The abort record: which rank failed, where and why, published once on the store.

The first record wins (`compare_set`), so every rank names the same failure;
`peerflow.distributed.faults` publishes and polls it. Through a `SignedStore`
(`peerflow.distributed.signing`) a record without the run's signature is not a failure.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import attrs

from peerflow.distributed.signing import RecordRefusedError
from peerflow.distributed.stages import PREFIX, read_stage
from peerflow.errors import WorkerFailedError

_COMM_ERROR_WORDS = ("gloo", "connection", "timed out", "timeout", "nccl", "closed",
                     "reset by peer", "broken pipe", "peer", "did not complete")


@attrs.frozen(kw_only=True)
class FailureRecord:
    """Which rank failed, where, in which stage and why."""

    rank: int
    host: str
    stage: str
    reason: str
    reporter: int

    def message(self) -> str:
        """Human form, as every rank prints it."""
        return (f"rank {self.rank} (host {self.host}) failed in stage {self.stage!r}: "
                f"{self.reason}")

    def to_json(self) -> str:
        """Serialised form stored under the abort key."""
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureRecord:
        """Parses `to_json`'s output."""
        return cls(**json.loads(text))


def hostname() -> str:
    """Returns this machine's host name (as failure records name it)."""
    return socket.gethostname()


def read_failure(store: Any) -> FailureRecord | None:
    """Returns the published abort record, or `None` if no rank failed."""
    if not store.check([PREFIX + "abort"]):
        return None
    try:
        return FailureRecord.from_json(store.get(PREFIX + "abort"))
    except RecordRefusedError:  # a stranger overwrote it since the check (logged)
        return None


def publish_failure(store: Any, record: FailureRecord) -> FailureRecord:
    """Publishes `record` unless another failure was published first; returns the winner."""
    current = store.compare_set(PREFIX + "abort", "", record.to_json())
    return FailureRecord.from_json(current)


def rank_info(store: Any, rank: int) -> tuple[str, str]:
    """Returns `(host, stage)` a rank last recorded (`?` when unknown)."""
    host = "?"
    if store.check([f"{PREFIX}host/{rank}"]):
        host = store.get(f"{PREFIX}host/{rank}").decode().rsplit(":", 1)[0]
    record = read_stage(store, rank)
    return host, record.label() if record is not None else "?"


def looks_like_comm_error(exc: BaseException) -> bool:
    """Whether an exception is what a collective raises when a peer vanished or timed out."""
    text = f"{type(exc).__name__} {exc}".lower()
    kinds = RuntimeError | ConnectionError | TimeoutError | WorkerFailedError
    return isinstance(exc, kinds) and any(w in text for w in _COMM_ERROR_WORDS)
