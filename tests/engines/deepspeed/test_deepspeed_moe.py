"""DeepSpeed ZeRO-2 and ZeRO-3 (one gloo rank) train tiny MoE models (Qwen3-MoE, Mixtral,
GPT-OSS) with r3 replay."""

from __future__ import annotations

import pytest
import torch

from peerflow import ParallelLayout, SamplingParams
from peerflow.engines import EngineContext, OptimSettings
from tests.engines.fsdp.fsdp_testlib import nll_loss, sampled_batch

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The model and a batch the hf engine sampled, routes recorded."""
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from tests.engines.hf.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("ds-moe"), arch="qwen3_moe",
                            num_experts=4, top_k=2, seed=3)
    engine = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))
    batch, _ = sampled_batch(engine, ["12+3=", "abc", "hello", "7-2="],
                             SamplingParams(n=2, max_tokens=8, seed=2, temperature=0.7))
    return path, batch


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_trains_moe_with_r3_and_syncs_experts_one_by_one(moe, stage):
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine
    from peerflow.adapters.deepspeed.options import DeepSpeedOptions
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.reshard.service import WeightSyncService

    path, batch = moe
    context = EngineContext(model_path=path, layout=ParallelLayout(), temperature=0.7)
    trainer = DeepSpeedTrainEngine(context, DeepSpeedOptions(zero_stage=stage),
                                   OptimSettings(lr=1e-2, routing_replay="r3",
                                                 router_aux_loss_coef=0.01))
    trainer.forward_logprobs(batch)
    metrics = trainer.train_step(batch, nll_loss)
    assert metrics["moe/replay_no_overlap"] == 0.0 and metrics["moe/aux_loss"] > 0
    names = {n for s in trainer.weight_sources() for n in s.names}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names
    rollout = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))
    WeightSyncService.build(trainer, rollout).sync(trainer.version)
    live = dict(rollout.model.named_parameters())
    with trainer.materialize(trainer.weight_sources()) as tensors:
        for spec, tensor in zip(trainer.weight_sources(), tensors, strict=True):
            target = live[spec.local_name]
            assert torch.equal(target.detach().reshape(tensor.shape), tensor), spec.local_name


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_zero3_loads_trains_and_syncs_mixtral_and_gpt_oss(arch, tmp_path):
    """ZeRO-3 fills the packed experts from the checkpoint's own names (Mixtral:
    `block_sparse_moe.experts.{e}.w1/w3/w2`, GPT-OSS: packed), trains with r3, exports
    canonical names and syncs to the hf engine bit-exact."""
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine
    from peerflow.adapters.deepspeed.options import DeepSpeedOptions
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.models import hf_parameters
    from peerflow.reshard.service import WeightSyncService
    from tests.engines.hf.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path, arch=arch, num_experts=4, top_k=2, seed=3)
    rollout = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))
    start = {n: p.detach().clone() for n, p in rollout.model.named_parameters()}
    batch, _ = sampled_batch(rollout, ["12+3=", "abc"],
                             SamplingParams(n=2, max_tokens=6, seed=2, temperature=0.7))
    context = EngineContext(model_path=path, layout=ParallelLayout(), temperature=0.7)
    trainer = DeepSpeedTrainEngine(context, DeepSpeedOptions(zero_stage=3),
                                   OptimSettings(lr=1e-2, routing_replay="r3"))
    names = {n for s in trainer.weight_sources() for n in s.names}
    assert names == set(hf_parameters(rollout.model.config))  # the checkpoint's names
    with trainer.materialize(trainer.weight_sources()) as tensors:  # loaded as hf loads
        for spec, tensor in zip(trainer.weight_sources(), tensors, strict=True):
            assert torch.equal(start[spec.local_name].reshape(tensor.shape), tensor)
    metrics = trainer.train_step(batch, nll_loss)
    assert metrics["moe/replay_no_overlap"] == 0.0
    WeightSyncService.build(trainer, rollout).sync(trainer.version)
    live = dict(rollout.model.named_parameters())
    with trainer.materialize(trainer.weight_sources()) as tensors:
        for spec, tensor in zip(trainer.weight_sources(), tensors, strict=True):
            assert torch.equal(live[spec.local_name].detach().reshape(tensor.shape), tensor)
    assert any(not torch.equal(start[n], live[n]) for n in live)
