"""Shared pieces of the fsdp tests: batches sampled by the hf engine, a loss."""

from __future__ import annotations

import torch

from peerflow import Batch, GenerationRequest, ParallelLayout, SamplingParams
from peerflow.batch import RaggedField
from peerflow.engines import EngineContext
from peerflow.routes import ROUTES, routes_column

STEPS = 3
PROMPTS = ["12+3=", "abc", "hello world", "7-2=", "zz", "the answer is"]


def make_batch(model_path: str) -> tuple[Batch, RaggedField]:
    """Samples 2 answers per prompt with the hf engine (fixed seed).

    Returns:
        The batch (`prompt_ids`, `response_ids`) and the rollout log-probs.
    """
    from peerflow.adapters.hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(EngineContext(model_path=model_path, layout=ParallelLayout()))
    tok = engine.tokenizer
    requests = [
        GenerationRequest(request_id=i, prompt_ids=tok(p).input_ids) for i, p in enumerate(PROMPTS)
    ]
    results = engine.generate(requests, SamplingParams(n=2, max_tokens=12, seed=3))
    logprobs = RaggedField.from_tensors([torch.tensor(r.logprobs) for r in results])
    return to_batch(requests, results), logprobs


def sampled_batch(engine, prompts: list[str], sampling: SamplingParams) -> tuple[Batch, list]:
    """`prompts` sampled by the rollout `engine`, as a training batch with its routes.

    Returns:
        The batch (`prompt_ids`, `response_ids`, and `ROUTES` when the engine recorded
        routed experts: a MoE model) and the generation results, in the batch's order.
    """
    requests = [GenerationRequest(request_id=i, prompt_ids=engine.tokenizer(p).input_ids)
                for i, p in enumerate(prompts)]
    results = engine.generate(requests, sampling)
    batch = to_batch(requests, results)
    routes = routes_column(results, [len(requests[r.request_id].prompt_ids) for r in results])
    if routes is not None:
        batch.set(ROUTES, routes)
    return batch, results


def to_batch(requests, results) -> Batch:
    """A training batch (`prompt_ids`, `response_ids`) from generation results."""
    batch = Batch(
        sample_id=range(len(results)),
        group_id=[r.request_id for r in results],
        weight_version=[0] * len(results),
    )
    batch.set("prompt_ids", RaggedField.from_tensors(
        [torch.tensor(requests[r.request_id].prompt_ids) for r in results], dtype=torch.long))
    batch.set("response_ids", RaggedField.from_tensors(
        [torch.tensor(r.token_ids) for r in results], dtype=torch.long))
    return batch


def nll_loss(logprobs: RaggedField, batch: Batch, *, global_tokens: int, global_samples: int):
    """Token-mean negative log-likelihood of the responses (normalised globally)."""
    loss = -logprobs.values.sum() / global_tokens
    return loss, {"nll_tokens": float(len(logprobs.values))}


def assemble(specs_per_rank, shards_per_rank) -> dict[str, torch.Tensor]:
    """Rebuilds full tensors from every rank's replica-0 shards, checking that every
    element is written exactly once."""
    full: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    for specs, shards in zip(specs_per_rank, shards_per_rank, strict=True):
        for spec, shard in zip(specs, shards, strict=True):
            assert tuple(shard.shape) == spec.local_shape
            if spec.replica:
                continue
            for piece in spec.pieces:  # several for packed MoE experts, one per expert
                if piece.name not in full:
                    full[piece.name] = torch.zeros(piece.global_shape, dtype=shard.dtype)
                    written[piece.name] = torch.zeros(piece.global_shape, dtype=torch.int64)
                full[piece.name][piece.global_box.slices()] = shard[piece.local_box.slices()]
                written[piece.name][piece.global_box.slices()] += 1
    for name, count in written.items():
        assert bool((count == 1).all()), f"{name}: elements written {count.unique().tolist()} times"
    return full
