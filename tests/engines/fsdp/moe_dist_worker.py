"""Worker of the two-rank fsdp MoE test (`test_fsdp_moe_distributed.py`).

Usage: python moe_dist_worker.py MODEL OUT

FSDP2 over dp = 2 (gloo) on a tiny Qwen3-MoE with `routing_replay: r2`: every rank takes
its half of a fixed batch, records its routes in the old-log-prob pass, trains two steps
replaying them, and saves its weight specs, their local shards and the full parameters.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from peerflow import ParallelLayout  # noqa: E402
from peerflow.adapters.fsdp.engine import FSDPTrainEngine  # noqa: E402
from peerflow.engines import EngineContext, OptimSettings  # noqa: E402
from tests.engines.fsdp.fsdp_testlib import make_batch, nll_loss  # noqa: E402


def main() -> None:
    model, out = sys.argv[1:3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ParallelLayout(dp=world)
    context = EngineContext(model_path=model, layout=layout, rank=rank,
                            process_group=dist.group.WORLD)
    engine = FSDPTrainEngine(context, None, OptimSettings(lr=1e-2, routing_replay="r2",
                                                          micro_batch_tokens=40))
    batch, _ = make_batch(model)
    local = batch.select(range(rank, len(batch), world))
    metrics = []
    for _ in range(2):
        engine.forward_logprobs(local)
        metrics.append(engine.train_step(local, nll_loss))
    specs = engine.weight_sources()
    with engine.materialize(specs) as tensors:
        shards = [t.clone() for t in tensors]
    full = {n: p.full_tensor().detach().clone() for n, p in engine.model.named_parameters()}
    torch.save({"metrics": metrics, "specs": specs, "shards": shards, "full": full},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
