"""The `fsdp` train engine in one process, and its token-balanced micro-batch packing."""

from __future__ import annotations

import attrs
import pytest
import torch

from peerflow import ParallelLayout
from peerflow.engines import EngineContext, OptimSettings
from peerflow.errors import ConfigError
from tests.engines.fsdp.fsdp_testlib import make_batch, nll_loss


def _engine(model, optim=None, **options):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions

    return FSDPTrainEngine(
        EngineContext(model_path=model, layout=ParallelLayout()),
        FSDPTrainOptions(**options),
        optim or OptimSettings(lr=1e-2),
    )


@pytest.fixture(scope="module")
def batch(tiny_model):
    return make_batch(tiny_model)[0]


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_registered_through_the_plugin_hooks(plugin_manager):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions

    assert plugin_manager.get("train_engine", "fsdp") is FSDPTrainEngine
    assert FSDPTrainEngine.options_class is FSDPTrainOptions
    caps = FSDPTrainEngine.capabilities
    assert caps.value_head and caps.checkpoint and caps.tensor_parallel


def test_packing_respects_the_budget_and_balances():
    from peerflow.training import pack_by_tokens, split_to_count

    lengths = [5, 30, 12, 12, 7, 40, 3, 9]
    bins = pack_by_tokens(lengths, budget=40)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        longest = max(lengths[i] for i in b)
        assert len(b) == 1 or len(b) * longest <= 40
    assert bins[0] == [5]  # longest first, alone: 40 tokens fill the budget
    more = split_to_count(bins, lengths, len(bins) + 2)
    assert len(more) == len(bins) + 2
    assert sorted(i for b in more for i in b) == list(range(len(lengths)))
    padded = split_to_count([[0]], lengths, 3)
    assert padded == [[0], [], []]  # a single sample cannot split: empty passes fill up


def test_micro_batch_size_does_not_change_the_step(tiny_model, batch):
    # eps=1e-3: Adam's first step moves even 1e-9 gradients by ~lr, which would turn
    # float summation-order noise into visible differences (see the distributed tests).
    one = _engine(tiny_model, OptimSettings(lr=1e-2, eps=1e-3, micro_batch_tokens=10_000))
    many = _engine(tiny_model, OptimSettings(lr=1e-2, eps=1e-3, micro_batch_tokens=30))
    m1 = one.train_step(batch, nll_loss)
    m2 = many.train_step(batch, nll_loss)
    assert m2["nll_tokens"] < m1["nll_tokens"]  # really split into several micro-batches
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    p1, p2 = _params(one), _params(many)
    assert max(float((p1[n] - p2[n]).abs().max()) for n in p1) < 1e-5


def test_mini_batches_take_several_optimizer_steps_per_call(tiny_model, batch):
    engine = _engine(tiny_model, OptimSettings(lr=1e-2, mini_batches=3))
    metrics = engine.train_step(batch, nll_loss)
    assert engine.version == 1
    steps = {float(s["step"]) for s in engine.optimizer.state.values()}
    assert steps == {3.0}
    assert metrics["lr"] == 1e-2 and metrics["grad_norm"] > 0


def test_grad_clip_bounds_the_update(tiny_model, batch):
    clipped = _engine(tiny_model, OptimSettings(lr=1e-2, grad_clip=1e-3))
    metrics = clipped.train_step(batch, nll_loss)
    assert metrics["grad_norm"] > 1e-3  # reported before clipping
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in clipped.model.parameters()))
    assert float(total) == pytest.approx(1e-3, rel=1e-3)


def test_logprobs_rise_on_the_trained_answers(tiny_model, batch):
    engine = _engine(tiny_model)
    before = engine.forward_logprobs(batch)
    for _ in range(3):
        engine.train_step(batch, nll_loss)
    after = engine.forward_logprobs(batch)
    assert torch.equal(before.offsets, batch.ragged("response_ids").offsets)
    assert float(after.values.mean()) > float(before.values.mean()) + 0.1


def test_checkpoint_resume_is_exact(tiny_model, batch, tmp_path):
    engine = _engine(tiny_model)
    engine.train_step(batch, nll_loss)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    continued = [engine.train_step(batch, nll_loss) for _ in range(2)]
    resumed = _engine(tiny_model)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.version == 1
    replayed = [resumed.train_step(batch, nll_loss) for _ in range(2)]
    assert continued == replayed
    p1, p2 = _params(engine), _params(resumed)
    assert all(torch.equal(p1[n], p2[n]) for n in p1)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "meta-rank0.json", "model-rank0.safetensors", "optim-rank0.safetensors"]


def test_weight_export_round_trip(tiny_model, batch):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    trainer = _engine(tiny_model)
    trainer.train_step(batch, nll_loss)
    specs = trainer.weight_sources()
    assert "lm_head.weight" not in {s.local_name for s in specs}
    rollout = HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout()))
    targets = {s.local_name: s for s in rollout.weight_targets()}
    assert set(targets) == {s.local_name for s in specs}
    with trainer.materialize(specs) as tensors:
        rollout.begin_weight_update(trainer.version)
        rollout.load_weights([(targets[s.local_name], t) for s, t in zip(specs, tensors,
                                                                          strict=True)])
        rollout.finish_weight_update()
    trained = dict(trainer.model.named_parameters())
    for name, param in rollout.model.named_parameters():
        assert torch.equal(param, trained[name].detach())


def test_critic_values_and_value_training(tiny_model, batch):
    from peerflow.batch import RaggedField

    critic = _engine(tiny_model, OptimSettings(lr=1e-2), value_head=True)
    values = critic.forward_values(batch)
    assert torch.equal(values.offsets, batch.ragged("response_ids").offsets)
    assert torch.all(values.values == 0)  # zero-initialised head
    lengths = batch.lengths("response_ids").tolist()
    target = RaggedField.from_tensors([torch.full((n,), 0.5) for n in lengths])
    batch_with_returns = batch.select(range(len(batch))).set("returns", target)

    def value_loss(vals, mb, *, global_tokens, global_samples):
        return ((vals.values - mb.ragged("returns").values) ** 2).sum() / global_tokens, {}

    first = critic.train_step(batch_with_returns, value_loss)["loss"]
    for _ in range(4):
        last = critic.train_step(batch_with_returns, value_loss)["loss"]
    assert last < first / 2
    with pytest.raises(RuntimeError, match="critic"):
        critic.forward_logprobs(batch)
    with pytest.raises(RuntimeError, match="value_head"):
        _engine(tiny_model).forward_values(batch)


def test_bf16_and_activation_checkpointing_train(tiny_model, batch):
    engine = _engine(tiny_model, OptimSettings(lr=1e-2, bf16=True, activation_checkpointing=True))
    exact = _engine(tiny_model).forward_logprobs(batch)
    approx = engine.forward_logprobs(batch)
    assert approx.values.dtype == torch.float32
    assert float((approx.values - exact.values).abs().max()) < 0.5  # bf16 rounding only
    losses = [engine.train_step(batch, nll_loss)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert next(engine.model.parameters()).dtype == torch.float32  # master weights


def test_unsupported_layouts_are_clear_errors(tiny_model):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine

    ctx = EngineContext(model_path=tiny_model, layout=ParallelLayout(pp=2))
    with pytest.raises(ConfigError, match="pp"):
        FSDPTrainEngine(ctx, None, OptimSettings())
    ctx = attrs.evolve(ctx, layout=ParallelLayout(dp=2))
    with pytest.raises(ConfigError, match="process_group is None"):
        FSDPTrainEngine(ctx, None, OptimSettings())


def test_checkpoint_of_another_model_is_refused(tiny_model, tmp_path):
    from tests.engines.hf.tiny_models import build_tiny_model

    _engine(tiny_model).save_checkpoint(str(tmp_path / "ckpt"))
    smaller = build_tiny_model(tmp_path / "smaller", hidden_size=32, intermediate_size=64)
    engine = _engine(smaller)
    before = _params(engine)
    with pytest.raises(ConfigError, match=r"shapes differ: .*saved \[\d+, 64\], model \[\d+, 32\]"):
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    after = _params(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was copied


def test_loss_mask_trains_only_the_model_tokens(tiny_model, batch):
    from peerflow.algorithms.losses import PPOClip
    from peerflow.batch import Batch, RaggedField

    offsets = batch.ragged("response_ids").offsets
    g = torch.Generator().manual_seed(7)
    total = int(offsets[-1])
    mask = torch.rand(total, generator=g) < 0.5
    advantages = torch.randn(total, generator=g)

    def with_fields(adv, loss_mask=None):
        out = Batch(sample_id=batch.sample_id, group_id=batch.group_id,
                    weight_version=batch.weight_version, fields=dict(batch.fields))
        out.set("advantages", RaggedField(values=adv, offsets=offsets))
        if loss_mask is not None:
            out.set("loss_mask", RaggedField(values=loss_mask, offsets=offsets))
        return out

    def step(b):
        engine = _engine(tiny_model, OptimSettings(lr=1e-2, eps=1e-3))
        engine.context = attrs.evolve(engine.context, temperature=0.7)
        metrics = engine.train_step(b, PPOClip())
        return _params(engine), metrics

    masked, _ = step(with_fields(advantages, mask))
    wild, _ = step(with_fields(torch.where(mask, advantages, 50.0), mask))
    assert all(torch.equal(masked[n], wild[n]) for n in masked)  # observations untrained
    plain, plain_metrics = step(with_fields(advantages))
    assert any(not torch.equal(masked[n], plain[n]) for n in masked)
    ones, ones_metrics = step(with_fields(advantages, torch.ones(total, dtype=torch.bool)))
    assert all(torch.equal(ones[n], plain[n]) for n in plain)
    assert ones_metrics == plain_metrics
