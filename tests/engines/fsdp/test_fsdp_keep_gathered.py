"""`trainer.fsdp.reshard_after_forward: false` (ZeRO-2 style) on two gloo ranks.

FSDP2 then keeps the gathered parameters from forward to backward instead of gathering
them again; the training must be the same bit for bit, and a forward without backward
(log-probs) must leave the parameters sharded, as the weight sync and checkpoints read them.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.gloo import run_gloo

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from peerflow import ParallelLayout
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.engines import EngineContext, OptimSettings
    from tests.engines.fsdp.fsdp_testlib import make_batch, nll_loss

    model = os.environ["PEERFLOW_TEST_MODEL"]
    context = EngineContext(model_path=model, layout=ParallelLayout(dp=world), rank=rank,
                            process_group=dist.group.WORLD)
    batch, _ = make_batch(model)
    local = batch.select(range(rank, len(batch), world))
    out: dict = {}
    for keep in (False, True):
        engine = FSDPTrainEngine(context, FSDPTrainOptions(reshard_after_forward=not keep),
                                 OptimSettings(lr=1e-2))
        losses = [engine.train_step(local, nll_loss)["loss"] for _ in range(2)]
        logprobs = engine.forward_logprobs(local).values.tolist()
        sharded = all(isinstance(p, DTensor) for p in engine.model.parameters())
        specs = engine.weight_sources()
        with engine.materialize(specs) as tensors:
            shapes_match = all(tuple(t.shape) == s.local_shape for t, s in zip(tensors, specs))
        out[keep] = {"losses": losses, "logprobs": logprobs, "sharded": sharded,
                     "shapes_match": shapes_match}
    return out


def test_keeping_gathered_parameters_trains_identically_and_reshards(tiny_model, monkeypatch):
    monkeypatch.setenv("PEERFLOW_TEST_MODEL", tiny_model)
    got = run_gloo(_worker, 2, timeout_s=120)
    for rank in range(2):
        default, kept = got[rank][False], got[rank][True]
        assert kept["losses"] == default["losses"]
        torch.testing.assert_close(torch.tensor(kept["logprobs"]),
                                   torch.tensor(default["logprobs"]), rtol=0, atol=0)
        assert kept["sharded"] and kept["shapes_match"] and default["sharded"]
