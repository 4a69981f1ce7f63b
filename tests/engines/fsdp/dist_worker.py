"""Worker for the multi-process fsdp tests, launched with `torch.distributed.run`.

Usage: python -m torch.distributed.run --nproc-per-node N dist_worker.py MODEL OUT dp|tp|dptp OPTIM

Every rank builds the same batch, trains `STEPS` steps with an NLL loss on its share of
the samples, and saves what the test checks: losses, log-probs, its weight specs and
local shards, and a checkpoint.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from peerflow import ParallelLayout  # noqa: E402
from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions  # noqa: E402
from peerflow.engines import EngineContext, OptimSettings  # noqa: E402
from tests.engines.fsdp.fsdp_testlib import STEPS, make_batch, nll_loss  # noqa: E402


def main() -> None:
    model, out, mode = sys.argv[1:4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = {"dp": ParallelLayout(dp=world), "tp": ParallelLayout(tp=world),
              "dptp": ParallelLayout(dp=world // 2, tp=2)}[mode]
    context = EngineContext(
        model_path=model, layout=layout, rank=rank, process_group=dist.group.WORLD
    )
    engine = FSDPTrainEngine(context, FSDPTrainOptions(), OptimSettings(**json.loads(sys.argv[4])))
    batch, _ = make_batch(model)
    dp_rank = layout.coord(rank).dp
    local = batch.select(range(dp_rank, len(batch), layout.dp))
    before = engine.forward_logprobs(local)
    losses = [engine.train_step(local, nll_loss)["loss"] for _ in range(STEPS)]
    after = engine.forward_logprobs(local)
    specs = engine.weight_sources()
    with engine.materialize(specs) as tensors:
        shards = [t.clone() for t in tensors]
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    # Resume on the same layout: the next step must be bit-identical.
    resumed = FSDPTrainEngine(context, FSDPTrainOptions(), OptimSettings(**json.loads(sys.argv[4])))
    resumed.load_checkpoint(os.path.join(out, "ckpt"))
    next_metrics = engine.train_step(local, nll_loss)
    resumed_metrics = resumed.train_step(local, nll_loss)
    resume_exact = next_metrics == resumed_metrics and all(
        torch.equal(a.to_local(), b.to_local()) if hasattr(a, "to_local") else torch.equal(a, b)
        for a, b in zip(engine.model.parameters(), resumed.model.parameters(), strict=True)
    )
    uneven = {}
    if mode == "dp":
        # Rank 1 has no samples: it must still join every collective of rank 0's passes.
        mine = local if rank == 0 else local.select([])
        uneven["logprobs"] = engine.forward_logprobs(mine)
        uneven["metrics"] = engine.train_step(mine, nll_loss)
    torch.save(
        {
            "sample_ids": local.sample_id,
            "before": before,
            "after": after,
            "losses": losses,
            "specs": specs,
            "shards": shards,
            "resume_exact": resume_exact,
            "uneven": uneven,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
