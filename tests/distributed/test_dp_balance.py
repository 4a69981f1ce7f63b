"""Balancing samples over dp-ranks after the advantage step changes who trains what, not
the step: two gloo ranks, one GRPO group each with long-tailed answer lengths (one rank
holds ~3x the other's tokens), an fsdp `train_step` at temperature 0.7 before and after
`redistribute(..., keep_groups=False)` — same loss, gradient norm and weights, for a
token-level and a sample-level loss aggregation, with near-equal tokens per rank after."""

from __future__ import annotations

import functools

import pytest
import torch

from peerflow.batch import Batch
from tests.helpers.gloo import run_gloo

pytestmark = pytest.mark.distributed

TEMPERATURE = 0.7
#: Group 0 (rank 0) has the long tail; group 1 (rank 1) short answers.
PROMPT_LENGTHS = [[5, 5, 5, 5], [7, 7, 7, 7]]
RESPONSE_LENGTHS = [[48, 3, 61, 9], [2, 11, 4, 6]]
#: Small enough for several micro-batches, and a different count on each rank.
OPTIM = {"lr": 1e-2, "eps": 1e-3, "grad_clip": 0.0, "micro_batch_tokens": 96}
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def _group(index: int, vocab: int) -> Batch:
    """Group `index`: its 4 answers, GRPO-style per-answer advantages, stale log-probs."""
    g = torch.Generator().manual_seed(100 + index)
    prompt = torch.randint(2, vocab, (PROMPT_LENGTHS[index][0],), generator=g)
    n = len(RESPONSE_LENGTHS[index])
    batch = Batch(sample_id=torch.arange(n) + 4 * index, group_id=torch.full((n,), index),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("prompt_ids", [prompt.clone() for _ in range(n)])
    responses = [torch.randint(2, vocab, (k,), generator=g) for k in RESPONSE_LENGTHS[index]]
    batch.set("response_ids", responses)
    per_answer = torch.randn(n, generator=g)
    batch.set("advantages", [torch.full((k,), float(a)) for k, a in
                             zip(RESPONSE_LENGTHS[index], per_answer, strict=True)])
    # Behaviour log-probs away from the policy's: ratios ≠ 1, some clipped.
    batch.set("old_logprobs", [-torch.rand(k, generator=g) * 6 for k in RESPONSE_LENGTHS[index]])
    batch.set_objects("example", [f"group {index} answer {j}" for j in range(n)])
    return batch


def _train(model_path: str, rank: int, batch: Batch, aggregation: str) -> dict:
    import torch.distributed as dist

    from peerflow import ParallelLayout
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.algorithms.losses import PPOClip, PPOClipOptions
    from peerflow.engines import EngineContext, OptimSettings

    context = EngineContext(model_path=model_path, layout=ParallelLayout(dp=2), rank=rank,
                            process_group=dist.group.WORLD, temperature=TEMPERATURE)
    engine = FSDPTrainEngine(context, FSDPTrainOptions(), OptimSettings(**OPTIM))
    metrics = engine.train_step(batch, PPOClip(PPOClipOptions(aggregation=aggregation)))
    with engine.materialize(engine.weight_sources()) as shards:
        weights = [t.clone() for t in shards]
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "weights": weights,
            "micro_batches": len(engine.plan_micro_batches(batch))}


def _worker(model_path: str, rank: int, world: int) -> dict:
    from transformers import AutoConfig

    from peerflow import ParallelLayout
    from peerflow.coordinator import TransferStats, redistribute

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    own = _group(rank, vocab)
    layout = ParallelLayout(dp=2)
    stats = TransferStats()
    balanced = redistribute(own, (layout, layout), keep_groups=False, stats=stats)
    out = {"tokens_before": int(own.token_count().sum()),
           "tokens_after": int(balanced.token_count().sum()),
           "sample_ids": balanced.sample_id.tolist(),
           "examples": list(balanced["example"]),
           "grouped": redistribute(own, (layout, layout)) is own,
           "plan_loads": (list(stats.plan.src_loads), list(stats.plan.dst_loads))}
    for aggregation in AGGREGATIONS:
        plain = _train(model_path, rank, own, aggregation)
        even = _train(model_path, rank, balanced, aggregation)
        weights = zip(plain.pop("weights"), even.pop("weights"), strict=True)
        out[aggregation] = {"unbalanced": plain, "balanced": even,  # plain data only
                            "weight_diff": max(float((a - b).abs().max()) for a, b in weights)}
    return out


def test_balancing_samples_gives_the_same_step_with_even_tokens(tiny_model):
    got = run_gloo(functools.partial(_worker, tiny_model), 2, timeout_s=240)
    before = [got[r]["tokens_before"] for r in range(2)]
    after = [got[r]["tokens_after"] for r in range(2)]
    assert sum(before) == sum(after)
    assert max(before) > 2.5 * min(before)  # one group holds most tokens
    longest = max(p + r for ps, rs in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)
                  for p, r in zip(ps, rs, strict=True))
    assert max(after) - min(after) < longest  # within one sample of even
    assert max(after) < 0.7 * max(before)
    assert got[0]["plan_loads"] == (before, after)
    # every sample on exactly one rank, travelling with its fields (Python objects too)
    ids = got[0]["sample_ids"] + got[1]["sample_ids"]
    assert sorted(ids) == list(range(8))
    for r in range(2):
        assert got[r]["examples"] == [f"group {i // 4} answer {i % 4}"
                                      for i in got[r]["sample_ids"]]
    assert {i // 4 for i in got[0]["sample_ids"]} == {0, 1}  # groups split
    assert got[0]["grouped"] and got[1]["grouped"]  # keep_groups on one layout: no move
    for aggregation in AGGREGATIONS:
        for r in range(2):
            plain, even = got[r][aggregation]["unbalanced"], got[r][aggregation]["balanced"]
            assert even["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
            assert even["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
            assert plain["grad_norm"] > 0
            assert got[r][aggregation]["weight_diff"] < 2e-6
        assert got[0][aggregation]["unbalanced"]["loss"] == got[1][aggregation]["unbalanced"][
            "loss"]


def test_sample_balance_on_one_layout_loads_ignore_dropped_samples():
    """A sample whose `train_mask` is false weighs nothing (training drops it)."""
    from peerflow.coordinator.units import Balance

    batch = _group(0, 50)
    batch.set("train_mask", torch.tensor([True, False, True, True]))
    assert Balance(keep_groups=False).loads(batch).tolist() == [53, 0, 66, 14]
    assert Balance(keep_groups=True).loads(batch).tolist() == [53, 8, 66, 14]
