"""Turning sampled answers into a `Batch`: one generate call of single-turn rollout.

`generate_batch` asks the rollout engine for `sampling.n` answers per prompt and packs
them into a ragged batch whose ids are global: a prompt's `group_id` is its stream
position (unique over the run) and `sample_id = group_id * n + index`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from peerflow.batch import Batch, RaggedField
from peerflow.engines import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from peerflow.rollout.prompts import encode_prompt
from peerflow.rollout.sampler import Draw
from peerflow.routes import ROUTES, routes_column


def step_seed(seed: int, step: int, dp_rank: int, attempt: int = 0) -> int:
    """Returns the sampling seed of one rank's generate call (deterministic on resume)."""
    return (seed * 1_000_003 + step * 10_007 + dp_rank * 101 + attempt) % (2**31 - 1)


def check_results(engine: Any, results: list[GenerationResult], num_requests: int,
                  n: int) -> list[GenerationResult]:
    """Returns `results` after checking them against the `RolloutEngine.generate` contract.

    Raises:
        RuntimeError: not `num_requests * n` results, or a result without one log-prob
            per token.
    """
    if len(results) != num_requests * n:
        raise RuntimeError(
            f"{type(engine).__name__}.generate returned {len(results)} results for "
            f"{num_requests} prompts × n={n}; the RolloutEngine contract requires "
            "len(requests) * n, grouped by request."
        )
    for res in results:
        if len(res.logprobs) != len(res.token_ids):
            raise RuntimeError(
                f"rollout engine {type(engine).__name__} returned {len(res.logprobs)} "
                f"log-probs for {len(res.token_ids)} tokens (request {res.request_id}); "
                "training needs the sampling policy's log-prob of every token (the behaviour "
                "policy of the off-policy correction, the mismatch metrics). Keep "
                "SamplingParams.logprobs true, and make the adapter fill "
                "GenerationResult.logprobs."
            )
    return results


def generate_batch(
    engine: RolloutEngine,
    tokenizer: Any,
    draws: Sequence[Draw],
    sampling: SamplingParams,
) -> Batch:
    """Samples `sampling.n` answers for each drawn prompt and packs them into a batch.

    Fields: `prompt_ids`, `response_ids` (ragged int64), `rollout_logprobs` (ragged
    float32, the sampling policy's log-probs), `finish_reason` and `example` (objects);
    with a MoE model on an engine that returns routes, `routed_experts` (`peerflow.routes`).
    """
    if not draws:
        return Batch.empty()
    prompts = [encode_prompt(tokenizer, d.example.prompt) for d in draws]
    requests = [GenerationRequest(request_id=d.position, prompt_ids=p)
                for d, p in zip(draws, prompts)]
    results = check_results(engine, engine.generate(requests, sampling), len(requests),
                            sampling.n)
    n = sampling.n
    by_request = {d.position: (d, p) for d, p in zip(draws, prompts)}
    owners = [by_request[res.request_id] for res in results]
    batch = Batch(
        sample_id=torch.tensor([d.position * n + res.index
                                for (d, _), res in zip(owners, results)]),
        group_id=torch.tensor([d.position for d, _ in owners]),
        weight_version=torch.full((len(results),), engine.weight_version, dtype=torch.int64),
    )
    batch.set("prompt_ids", RaggedField.from_lists([p for _, p in owners], torch.int64))
    batch.set("response_ids", RaggedField.from_lists([r.token_ids for r in results],
                                                     torch.int64))
    batch.set("rollout_logprobs", RaggedField.from_lists([r.logprobs for r in results],
                                                         torch.float32))
    routes = routes_column(results, [len(p) for _, p in owners])  # MoE engines' routes
    if routes is not None:
        batch.set(ROUTES, routes)
    batch.set_objects("finish_reason", [res.finish_reason for res in results])
    batch.set_objects("example", [d.example for d, _ in owners])
    return batch


def group_count(batch: Batch) -> int:
    """Number of distinct groups in a batch."""
    return len(set(batch.group_id.tolist()))
