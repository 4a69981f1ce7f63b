"""The proximal fast path: with one optimiser step per batch the planner drops
`old_logprob` (sync or async), the loss uses the detached current log-probs as π_prox, and
the off-policy correction against the behaviour policy still applies."""

from __future__ import annotations

import json

import pytest
import torch

from peerflow.algorithms.setup import build_algorithm
from peerflow.batch import Batch, RaggedField
from peerflow.config import load_config
from peerflow.planner import plan_run
from peerflow.worker.metrics import StepMetrics, reduce_metrics
from peerflow.workflow.on_policy import old_logprob_decision

CUSTOM_WITH_OLD = """
workflow:
  nodes:
    - {name: generate}
    - {name: reward}
    - {name: old_logprob}
    - {name: advantage, outputs: [advantages]}
    - {name: train_actor}
    - {name: sync_weights, after: [train_actor], options: {target: rollout}}
"""


def _decision(overrides, yaml_text=None, tmp_path=None):
    path = None
    if yaml_text is not None:
        path = tmp_path / "run.yaml"
        path.write_text(yaml_text)
    config = load_config(str(path) if path else None, overrides)
    plan = plan_run(config, 2)
    return plan, old_logprob_decision(config, plan.graph)


@pytest.mark.parametrize("overrides", [
    [],
    # stale samples: the behaviour policy lags, but pi_prox is still the trained weights
    ["runtime.mode=async", "runtime.placement=split", "runtime.max_staleness=2"],
    ["weight_sync.every=2"],
])
def test_one_optimiser_step_drops_old_logprob(overrides):
    plan, decision = _decision(overrides)
    assert "old_logprob" not in plan.graph.kinds()
    assert "rollout_logprobs" in plan.graph.node("train_actor").inputs
    assert not decision.kept
    assert decision.describe() == ("old_logprob dropped: 1 optimiser step per batch, so the "
                                   "training forward gives π_prox")


@pytest.mark.parametrize("overrides,why", [
    (["trainer.mini_batches=2"], "trainer.mini_batches=2"),
    (["runtime.mode=async", "runtime.placement=split", "trainer.mini_batches=2"],
     "trainer.mini_batches=2"),
    (["workflow.graph=ppo", "algorithm.advantage=gae"], "workflow.graph=ppo"),
])
def test_off_policy_configs_keep_old_logprob(overrides, why):
    plan, decision = _decision(overrides)
    assert "old_logprob" in plan.graph.kinds()
    assert "old_logprobs" in plan.graph.node("train_actor").inputs
    assert decision.kept and why in decision.reason


def test_a_custom_graph_that_asks_for_old_logprob_keeps_it(tmp_path):
    plan, decision = _decision([], CUSTOM_WITH_OLD, tmp_path)
    assert "old_logprob" in plan.graph.kinds()
    assert decision.kept and decision.reason == "workflow.nodes lists an old_logprob node"


def test_plan_cli_shows_the_decision(tmp_path, capsys):
    from peerflow.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("trainer: {mini_batches: 2}\n")
    assert main(["plan", str(config), "--nprocs", "2"]) == 0
    assert "old_logprob kept: trainer.mini_batches=2" in capsys.readouterr().out
    config.write_text("seed: 1\n")
    assert main(["plan", str(config), "--nprocs", "2", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["old_logprob"] == {
        "kept": False, "reason": "1 optimiser step per batch, so the training forward gives π_prox"}


def _sampled_batch(temperature=0.7, lengths=(3, 5, 2, 4), vocab=11, seed=0):
    """Tokens sampled (non-greedy) from a toy policy at `temperature`; the trainer's
    policy differs a little from the sampler's (rollout-vs-trainer mismatch)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lengths)
    sampler_logits = torch.randn(n, max(lengths), vocab, generator=gen, dtype=torch.float64)
    trainer_logits = sampler_logits + 0.3 * torch.randn(sampler_logits.shape, generator=gen,
                                                        dtype=torch.float64)
    trainer_logits.requires_grad_(True)
    tokens, rollout, current = [], [], []
    for i, k in enumerate(lengths):
        probs = torch.softmax(sampler_logits[i, :k] / temperature, -1)
        ids = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        tokens.append(ids)
        rollout.append(torch.log(probs.gather(1, ids[:, None])).squeeze(1).float())
        trainer_lp = torch.log_softmax(trainer_logits[i, :k] / temperature, -1)
        current.append(trainer_lp.gather(1, ids[:, None]).squeeze(1))
    batch = Batch(sample_id=torch.arange(n), group_id=torch.tensor([0, 0, 1, 1]),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("response_ids", tokens)
    batch.set("rollout_logprobs", rollout)
    batch.set("advantages", [torch.randn(k, generator=gen) for k in lengths])
    flat = torch.cat(current)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return batch, RaggedField(values=flat, offsets=offsets), trainer_logits


@pytest.mark.parametrize("loss,correction", [("ppo_clip", "tis"), ("ppo_clip", "mis"),
                                             ("gspo", "tis")])
def test_fast_path_loss_equals_explicit_current_old_logprobs(plugin_manager, loss,
                                                             correction):
    config = load_config(None, [f"algorithm.loss={loss}",
                                f"algorithm.off_policy.correction={correction}",
                                "algorithm.off_policy.cap=1.2", "algorithm.off_policy.lower=0.8"])
    algo = build_algorithm(config.algorithm, plugin_manager=plugin_manager)
    results = []
    for explicit in (False, True):
        batch, logprobs, logits = _sampled_batch()
        if explicit:
            batch.set("old_logprobs", [row.detach() for row in logprobs.rows()])
        step = StepMetrics()
        actor_batch = algo.prepare_actor_batch(batch, step)
        value, metrics = algo.policy_loss(logprobs, actor_batch, global_tokens=14,
                                          global_samples=4)
        step.add_engine_metrics("actor", metrics, 1.0)
        value.backward()
        results.append((value.detach(), logits.grad.clone(), reduce_metrics([step.raw()])))
    (fast, fast_grad, fast_m), (slow, slow_grad, slow_m) = results
    assert torch.allclose(fast, slow, atol=1e-12) and torch.allclose(fast_grad, slow_grad,
                                                                      atol=1e-12)
    assert fast_grad.abs().sum() > 0
    for name in ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/kl",
                 "off_policy/is_weight_mean", "off_policy/is_weight_max",
                 "off_policy/applied_weight_mean"):
        assert fast_m[name] == pytest.approx(slow_m[name], rel=1e-9), name
    assert fast_m["mismatch/abs_max"] > 1e-3  # the trainer and the sampler really differ
    limited = "masked_fraction" if correction == "mis" else "truncated_fraction"
    assert 0 < fast_m[f"off_policy/{limited}"] < 1
    assert fast_m["actor/ratio_mean"] == pytest.approx(1.0)
