"""FSDP2 (dp = 2, gloo) on a tiny Qwen3-MoE: r2 replay, experts sharded and exported whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peerflow import ParallelLayout
from tests.engines.fsdp.fsdp_testlib import assemble
from tests.helpers.gloo import run_script

pytestmark = pytest.mark.distributed


def test_dp2_moe_replays_routes_and_exports_experts_one_by_one(tmp_path):
    from transformers import AutoConfig

    from peerflow.adapters.fsdp.layout import fsdp_shard_layout
    from tests.engines.hf.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_experts=4, top_k=2)
    run_script(Path(__file__).with_name("moe_dist_worker.py"), model, str(tmp_path),
               nprocs=2, timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, result in enumerate(ranks):
        # the live FSDP2 shards are what the pure layout function declares
        declared = fsdp_shard_layout(AutoConfig.from_pretrained(model), ParallelLayout(dp=2),
                                     rank)
        assert {s.local_name: s for s in result["specs"]} == {s.local_name: s for s in declared}
        for step in result["metrics"]:
            assert step["moe/replay_no_overlap"] == 0.0  # its own routes, same weights
            assert step["moe/rows_without_routes"] == 0.0
    full = assemble([r["specs"] for r in ranks], [r["shards"] for r in ranks])
    packed = ranks[0]["full"]["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    width = packed.shape[1] // 2
    for e in range(4):  # each expert's gate and up rows, canonical and byte-exact
        assert torch.equal(full[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"],
                           packed[e, :width])
        assert torch.equal(full[f"model.layers.1.mlp.experts.{e}.up_proj.weight"],
                           packed[e, width:])
    down = ranks[1]["full"]["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(full["model.layers.0.mlp.experts.3.down_proj.weight"], down[3])
