"""A tiny Qwen3-MoE end to end on the CPU: hf rollout (bf16) → fsdp trainer (fp32).

The rollout engine samples at T = 0.7 in bfloat16 and records every token's experts (R3);
the trainer scores the same tokens in float32, where some tokens' router scores fall the
other way. Replaying the rollout's routes (r3) brings the trainer's log-probs closer to
the rollout's than native routing; r2 replays the trainer's own old-log-prob routes.
"""

from __future__ import annotations

import pytest
import torch

from peerflow import Batch, ParallelLayout, SamplingParams
from peerflow.batch import RaggedField
from peerflow.engines import EngineContext, OptimSettings
from peerflow.routes import OLD_ROUTES, ROUTES
from tests.engines.fsdp.fsdp_testlib import nll_loss, sampled_batch

TEMPERATURE = 0.7
PROMPTS = ["12+3=", "abc", "hello world", "7-2=", "zz", "the answer is", "q", "99"]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    from tests.engines.hf.tiny_models import build_tiny_qwen3_moe

    # 8 experts: the route and expert-shape assertions below count them
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"), num_experts=8)


@pytest.fixture(scope="module")
def rollout(moe_model):
    """Samples 2 answers per prompt in bfloat16 at T = 0.7, routes recorded."""
    from peerflow.adapters.hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(EngineContext(model_path=moe_model, layout=ParallelLayout(),
                                           dtype="bfloat16"))
    assert engine.capabilities.routed_experts
    batch, results = sampled_batch(engine, PROMPTS, SamplingParams(
        n=2, max_tokens=12, seed=3, temperature=TEMPERATURE))
    logprobs = RaggedField.from_tensors([torch.tensor(r.logprobs) for r in results])
    return batch, logprobs, results


def _trainer(model: str, mode: str, **optim):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine

    context = EngineContext(model_path=model, layout=ParallelLayout(), seed=0,
                            temperature=TEMPERATURE)
    return FSDPTrainEngine(context, optim=OptimSettings(lr=1e-2, routing_replay=mode,
                                                        micro_batch_tokens=64, **optim))


def test_hf_engine_records_one_route_per_token(rollout):
    batch, _, results = rollout
    routes = batch.ragged(ROUTES)
    assert routes.values.dtype == torch.int16 and routes.values.shape[1:] == (2, 2)
    expected = batch.lengths("prompt_ids") + batch.lengths("response_ids")
    assert torch.equal(routes.lengths, expected)
    for i, result in enumerate(results):
        row = routes.row(i)
        assert bool((row[:-1] >= 0).all())  # every fed token has its experts
        assert bool((row[-1] == -1).all()), result.finish_reason  # the last token: never fed
        assert bool((row[:-1] < 8).all())
        assert bool((row[:-1, :, 0] != row[:-1, :, 1]).all())  # k distinct experts


def _mismatch(trainer, batch, rollout_logprobs) -> tuple[float, float]:
    """Mean |log-prob difference| and the KL estimate `mean(lp_rollout - lp_trainer)`."""
    trained = trainer.forward_logprobs(batch)
    diff = rollout_logprobs.values - trained.values
    return float(diff.abs().mean()), float(diff.mean())


def test_r3_replay_shrinks_the_rollout_trainer_mismatch(moe_model, rollout):
    batch, logprobs, _ = rollout
    native, native_kl = _mismatch(_trainer(moe_model, "off"), batch, logprobs)
    replayed, replayed_kl = _mismatch(_trainer(moe_model, "r3"), batch, logprobs)
    print(f"mean |dlogp| native {native:.5f} r3 {replayed:.5f}; "
          f"KL native {native_kl:.6f} r3 {replayed_kl:.6f}")
    assert replayed < native
    assert abs(replayed_kl) < abs(native_kl)


def test_r3_train_step_replays_overlapping_routes_and_trains_the_router(moe_model, rollout):
    batch, _, _ = rollout
    trainer = _trainer(moe_model, "r3", router_aux_loss_coef=0.01)
    router = trainer.model.model.layers[0].mlp.gate.weight
    before = router.detach().clone()
    trainer.forward_logprobs(batch)
    metrics = trainer.train_step(batch, nll_loss)
    print({k: round(v, 5) for k, v in metrics.items() if k.startswith("moe/")})
    assert metrics["moe/replay_no_overlap"] < 0.05  # bf16 vs fp32: a few tokens at most
    assert metrics["moe/replay_changed"] > 0  # ... but some routes differ: a real mismatch
    assert metrics["moe/rows_without_routes"] > 0  # the last sampled tokens
    assert metrics["moe/aux_loss"] > 0 and "moe/load_violation" in metrics
    assert metrics["moe/route_bytes"] == batch.ragged(ROUTES).values.numel() * 2 + 8 * (
        len(batch) + 1)
    assert not torch.equal(router.detach(), before)  # the live router keeps learning


def test_r2_replays_the_trainers_own_routes(moe_model, rollout):
    batch, _, _ = rollout
    trainer = _trainer(moe_model, "r2")
    plain = Batch(sample_id=batch.sample_id, group_id=batch.group_id,
                  weight_version=batch.weight_version,
                  fields={k: v for k, v in batch.fields.items() if k != ROUTES})
    metrics = trainer.train_step(plain, nll_loss)  # no old-log-prob pass: nothing to replay
    assert "moe/replay_changed" not in metrics and "moe/rows_without_routes" not in metrics
    half = len(plain) // 2  # old log-probs per micro-batch, as async streaming runs them
    parts = [plain.select(range(half)), plain.select(range(half, len(plain)))]
    for part in parts:
        trainer.forward_logprobs(part)  # adds the pass's routes to the batch
    # the coordinator may hand the samples to the update in another order: routes go along
    joined = Batch.concat(parts[::-1])
    assert joined.ragged(OLD_ROUTES).values.dtype == torch.int16
    assert torch.equal(joined.ragged(OLD_ROUTES).lengths,
                       joined.lengths("prompt_ids") + joined.lengths("response_ids"))
    metrics = trainer.train_step(joined, nll_loss)
    assert metrics["moe/replay_no_overlap"] == 0.0  # same weights, same routes
    assert metrics["moe/replay_changed"] == 0.0 and metrics["moe/rows_without_routes"] == 0.0
    metrics = trainer.train_step(joined, nll_loss)  # a second epoch replays them again
    assert metrics["moe/replay_changed"] > 0  # ... now that the weights have moved


def test_r3_without_routes_fails_closed(moe_model, rollout):
    batch, _, _ = rollout
    plain = batch.select(range(len(batch)))
    del plain.fields[ROUTES]
    with pytest.raises(ValueError, match="routing_replay: r3"):
        _trainer(moe_model, "r3").forward_logprobs(plain)


def test_weight_sync_moves_experts_one_by_one_bit_exact(moe_model, rollout):
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.reshard.service import WeightSyncService

    batch, _, _ = rollout
    trainer = _trainer(moe_model, "off")
    trainer.train_step(batch, nll_loss)
    engine = HFRolloutEngine(EngineContext(model_path=moe_model, layout=ParallelLayout()))
    experts = [s for s in trainer.weight_sources() if ".mlp.experts." in s.local_name]
    assert experts and all(s.local_shape in ((8 * 128, 64), (8 * 64, 64)) for s in experts)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in {n for s in experts
                                                              for n in s.names}
    WeightSyncService.build(trainer, engine).sync(trainer.version)
    live = dict(engine.model.named_parameters())
    for name, param in trainer.model.named_parameters():
        assert torch.equal(live[name], param.detach()), name


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_mixtral_and_gpt_oss_train_with_r3_and_sync_to_hf(arch, tmp_path):
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.reshard.service import WeightSyncService
    from tests.engines.hf.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch=arch, num_experts=4, top_k=2, seed=4)
    engine = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))
    batch, _ = sampled_batch(engine, PROMPTS[:4], SamplingParams(
        n=2, max_tokens=8, seed=1, temperature=TEMPERATURE))
    trainer = _trainer(path, "r3", router_aux_loss_coef=0.01)
    trainer.forward_logprobs(batch)
    metrics = trainer.train_step(batch, nll_loss)
    assert metrics["moe/replay_no_overlap"] == 0.0  # float32 on both sides
    assert metrics["moe/aux_loss"] > 0
    live = dict(engine.model.named_parameters())
    assert any(not torch.equal(live[n], p.detach()) for n, p in trainer.model.named_parameters())
    WeightSyncService.build(trainer, engine).sync(trainer.version)  # by checkpoint names
    for name, param in trainer.model.named_parameters():
        assert torch.equal(live[name], param.detach()), name
