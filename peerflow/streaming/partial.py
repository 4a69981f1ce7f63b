"""Partial rollout: let new weights take over a request part-way, keeping segment versions.

`generate_in_segments` samples answers in chunks of at most `chunk_tokens` tokens. After
each chunk it calls `between_chunks()` — where the rollout loop applies a newly pushed
weight version — and continues every unfinished answer as a new request (the prompt plus
the tokens generated so far, `n = 1`), under whatever weights are then loaded. Each
answer's `version_segments` records `(first_token_index, version)` for every run of
tokens produced by one version, and its per-token log-probs are those of the policy that
produced each token, as the truncated importance-sampling correction needs.

This works on every engine (it only uses `generate`), at the cost of re-reading the
prefix when a request continues (engines with a prefix cache make that cheap). Engines
that pause in-flight requests themselves (`Capabilities.partial_rollout`) report their own
segments inside a chunk; those are merged, offset by the chunk's start.

A mixture-of-experts engine's `routed_experts` are merged the same way: tokens keep the
routes of the weights they were fed under (`_merge_routes`).

Stop strings are matched within a chunk; one spanning a chunk boundary is found only if
the engine's tokenizer-level stop handling sees the whole string in the continuation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from peerflow.engines import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from peerflow.streaming.versions import append_segment


@attrs.define(eq=False)
class _Answer:
    request_id: int
    index: int
    prompt: tuple[int, ...]
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    segments: tuple[tuple[int, int], ...] = ()
    finish_reason: str = "length"
    done: bool = False
    routes: torch.Tensor | None = None  # [prompt + tokens, layers, k] (MoE engines)


def _continue_seed(seed: int | None, chunk: int) -> int | None:
    if seed is None:
        return None
    return (seed * 7919 + chunk * 104_729) % (2**31 - 1)


def _absorb(answer: _Answer, result: GenerationResult, version: int, limit: int) -> None:
    start = len(answer.tokens)
    own = result.version_segments or ((0, version),)
    for offset, seg_version in own:
        answer.segments = append_segment(answer.segments, start + offset, seg_version)
    answer.tokens += list(result.token_ids)
    answer.logprobs += list(result.logprobs)
    answer.routes = _merge_routes(answer.routes, result.routed_experts)
    answer.finish_reason = result.finish_reason
    answer.done = result.finish_reason != "length" or len(answer.tokens) >= limit


def _merge_routes(held: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """An answer's routes after a chunk (MoE engines that return `routed_experts`).

    A continuation re-reads the prompt and every token so far, so its routes cover them
    all: tokens fed in earlier chunks keep the routes of the weights they were fed under;
    the previous last token (never fed before, -1) and the new tokens take this chunk's.
    """
    if held is None or new is None:
        return new
    fed = len(held) - 1
    return torch.cat([held[:fed], new[fed:]])


def _within_limit(res: GenerationResult, answer: _Answer, limit: int) -> GenerationResult:
    """`res` cut to the room `answer` has left (the shared chunk budget may overshoot it)."""
    room = limit - len(answer.tokens)
    if len(res.token_ids) <= room:
        return res
    routes = res.routed_experts
    return attrs.evolve(
        res, token_ids=res.token_ids[:room], logprobs=res.logprobs[:room],
        finish_reason="length", routed_experts=None if routes is None else routes[
            : len(answer.prompt) + len(answer.tokens) + room])


def generate_in_segments(
    engine: RolloutEngine,
    requests: Sequence[GenerationRequest],
    sampling: SamplingParams,
    *,
    chunk_tokens: int,
    between_chunks: Callable[[], None] = lambda: None,
) -> list[GenerationResult]:
    """Samples `sampling.n` answers per request, letting weights change between chunks.

    Args:
        engine: The rollout engine.
        requests: Prompts.
        sampling: Sampling settings; `max_tokens` bounds each whole answer.
        chunk_tokens: Most tokens generated before weights may change (≥ 1).
        between_chunks: Called after every chunk that leaves answers unfinished.

    Returns:
        `len(requests) * n` results grouped by request, like `RolloutEngine.generate`,
        with `version_segments` filled.

    Raises:
        ValueError: `chunk_tokens` is less than 1.
    """
    if chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens={chunk_tokens}: partial rollout needs at least 1 token per chunk."
        )
    limit = sampling.max_tokens
    first = attrs.evolve(sampling, max_tokens=min(chunk_tokens, limit))
    results = engine.generate(requests, first)
    prompts = {r.request_id: tuple(r.prompt_ids) for r in requests}
    answers = []
    for res in results:
        answer = _Answer(request_id=res.request_id, index=res.index, prompt=prompts[res.request_id])
        _absorb(answer, res, engine.weight_version, limit)
        answers.append(answer)
    chunk = 1
    while True:
        open_answers = [a for a in answers if not a.done]
        if not open_answers:
            break
        between_chunks()
        version = engine.weight_version
        budget = min(chunk_tokens, limit - min(len(a.tokens) for a in open_answers))
        params = attrs.evolve(
            sampling, n=1, max_tokens=budget, seed=_continue_seed(sampling.seed, chunk)
        )
        continued = engine.generate(
            [
                GenerationRequest(request_id=i, prompt_ids=a.prompt + tuple(a.tokens))
                for i, a in enumerate(open_answers)
            ],
            params,
        )
        for res in continued:
            answer = open_answers[res.request_id]
            _absorb(answer, _within_limit(res, answer, limit), version, limit)
        chunk += 1
    return [
        GenerationResult(
            request_id=a.request_id,
            index=a.index,
            token_ids=a.tokens,
            logprobs=a.logprobs,
            finish_reason=a.finish_reason,
            version_segments=a.segments,
            routed_experts=a.routes,
        )
        for a in answers
    ]
