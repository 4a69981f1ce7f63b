"""Process groups with timeouts, fault detection and propagation.

Interface for the worker (`peerflow.worker`):

* `init_distributed(backend="auto", timeout=fault_timeout) -> DistContext` — idempotent;
  under `peerflow train` the launcher's entry has already called it;
* `with stage("generate", deadline=…): …` around every node, weight sync and checkpoint:
  if this rank raises, every other rank exits within `fault_timeout` naming it (rank,
  host, stage); if a peer dies, this rank exits naming the peer (`PEER_FAILED_EXIT`);
  if the block outlives its deadline, the run fails naming this rank, the stage and
  where it is stuck; `describe_stage("reward 'x' on samples 3-5")` adds what it works on;
* `wait_all`, `all_gather_tensor`, `all_gather_ragged`, `barrier` — collectives and p2p
  waits with a timeout;
* `shutdown_distributed()` at the end of a clean run.
"""

from peerflow.distributed.comm import (
    all_gather_ragged,
    all_gather_tensor,
    barrier,
    default_timeout,
    wait_all,
)
from peerflow.distributed.failure import FailureRecord, read_failure
from peerflow.distributed.fault_scope import (
    current_monitor,
    describe_stage,
    handle_failure,
    raise_if_failed,
    stage,
)
from peerflow.distributed.faults import PEER_FAILED_EXIT, FaultMonitor
from peerflow.distributed.init import (
    FAULT_SCOPE_ENV,
    FAULT_STORE_ENV,
    DistContext,
    dist_context,
    init_distributed,
    shutdown_distributed,
)

__all__ = [
    "FAULT_SCOPE_ENV",
    "FAULT_STORE_ENV",
    "PEER_FAILED_EXIT",
    "DistContext",
    "FailureRecord",
    "FaultMonitor",
    "all_gather_ragged",
    "all_gather_tensor",
    "barrier",
    "current_monitor",
    "default_timeout",
    "describe_stage",
    "dist_context",
    "handle_failure",
    "init_distributed",
    "raise_if_failed",
    "read_failure",
    "shutdown_distributed",
    "stage",
    "wait_all",
]
