"""One gloo rank of test_checkpoint_refusal: argv RUN_DIR. Saves step 1 with the run
driver's `save_step`, resumes it, then (rank 0) plants a crafted pickle, forges the
manifest, and resumes again: writes `RUN_DIR/rank{R}.json` with what each rank saw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from peerflow.checkpoint import restore_latest, save_step, step_dir
from peerflow.checkpoint.pickles import UntrustedCheckpointError
from tests.helpers.hostile import forge_manifest, plant


def main() -> None:
    dist.init_process_group("gloo")
    rank, run = dist.get_rank(), Path(sys.argv[1])
    save_step(run, 1, engines={}, rank=rank, log=lambda _: None)
    result = {"resumed": restore_latest(run, engines={}, rank=rank, report=print).step}
    if rank == 0:
        (step_dir(run, 1) / "actor").mkdir()
        plant(step_dir(run, 1) / "actor" / "optim.pt", run / "pwned")
        forge_manifest(step_dir(run, 1))
    dist.barrier()
    try:
        restore_latest(run, engines={}, rank=rank, report=print)
        result["refusal"] = None
    except UntrustedCheckpointError as exc:
        result["refusal"] = str(exc)
    (run / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
