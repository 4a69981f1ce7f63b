"""Sampling one turn of every open trajectory: per-turn settings, choices and branches.

The driver (`peerflow.agents.rollout`) samples each turn of all open trajectories in as
few engine calls as their settings allow. A trajectory's turn normally uses the run's
`rollout.sampling`; an environment may ask for more through `Environment.turn_settings()`
(the policy endpoint passes a request's `n`, `max_tokens`, `stop`, `seed`): trajectories
asking the same (`n`, stop strings, stop ids, seed, and, on the first turn, how many of a
group share the prompt) share one engine call; the run's temperature, top-p and top-k
(what the trainer's log-probs assume) are never changed here.

Choices: a turn that asks for `n > 1` answers gets them from one request (`n` samples of
the same input, as vLLM's `n`). Choice 0 is appended to the trajectory; every other
choice becomes a sample of its own at once — the trajectory's tokens so far plus that
answer, `finish_reason` `branch`, the same group and episode (so the episode's reward) —
and when the environment continues with choice k (`StepResult.choice`), the trajectory
and branch k swap their answers (`swap_answers`), so the trajectory always holds the
answer the next input extends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from peerflow.agents.environment import Turn, TurnSettings
from peerflow.agents.packing import failure_of
from peerflow.agents.routes import add_turn_routes
from peerflow.engines import GenerationRequest, RolloutEngine, SamplingParams
from peerflow.rollout.generate import check_results
from peerflow.streaming.versions import token_versions

#: The content of a trajectory that an answer swap exchanges (everything a turn appends).
_CONTENT = (
    "tokens",
    "logprobs",
    "mask",
    "versions",
    "token_rewards",
    "last_sampled",
    "routes",
    "turns",
    "last_turn",
)


class Segments:
    """Numbers the samples of each episode.

    0 for its first, then 1, 2, … for the samples a restart or a branch adds (their sample
    ids: `peerflow.agents.rollout.SEGMENT_STRIDE`).
    """

    def __init__(self) -> None:
        self._used: dict[int, int] = {}

    def next(self, env: Any) -> int:
        """The next free segment number of `env`'s episode."""
        count = self._used.get(id(env), 1)
        self._used[id(env)] = count + 1
        return count


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The run's seed of a turn's engine call (turn 0: the call's own)."""
    if seed is None or turn == 0:
        return seed
    return (seed * 7919 + turn * 1_000_033) % (2**31 - 1)


def _settings(t: Any) -> TurnSettings:
    settings = t.env.turn_settings()
    return settings if isinstance(settings, TurnSettings) else TurnSettings()


def _plan(
    active: Sequence[Any], turn: int, sampling: SamplingParams
) -> dict[tuple, list[tuple[list[int], list[Any]]]]:
    """Engine calls by key: each a list of requests (prompt ids, their trajectories).

    On the first turn a group's trajectories with the same settings share one request.
    """
    calls: dict[tuple, list[tuple[list[int], list[Any]]]] = {}
    shared: dict[tuple, list[Any]] = {}
    for t in active:
        s = _settings(t)
        key = (s.n, s.stop, s.stop_token_ids, s.seed)
        if turn == 0 and sampling.n > 0:
            shared.setdefault((*key, t.draw.position), []).append(t)
        else:
            calls.setdefault((*key, 1), []).append((t.prompt + t.tokens, [t]))
    for key, ts in shared.items():
        calls.setdefault((*key[:4], len(ts)), []).append((list(ts[0].prompt), ts))
    return calls


def sample_turns(
    engine: RolloutEngine,
    tokenizer: Any,
    active: Sequence[Any],
    sampling: SamplingParams,
    turn: int,
    limits: Any,
    chunk_tokens: int,
    between: Callable[[], None],
    segments: Segments,
) -> list[Any]:
    """Samples the next turn of every active trajectory.

    Args:
        engine: The rollout engine.
        tokenizer: Decodes each turn's text.
        active: The open trajectories (`peerflow.agents.rollout.Trajectory`).
        sampling: The run's sampling settings (`n` is the group size).
        turn: Which turn (0: the first, sampled `sampling.n` times per prompt).
        limits: The run's `AgentConfig` (`max_turn_tokens`, `max_total_tokens`).
        chunk_tokens: Partial rollout's most tokens per generate call (0: whole turns).
        between: Called between chunks.
        segments: Numbers the branch samples.

    Returns:
        The branch samples the turn's extra choices made (already ended).

    Raises:
        Exception: What the engine raised, when it failed on every prompt of the turn
            (one prompt it fails on alone ends only its trajectories, `env_error`).
    """
    branches: list[Any] = []
    errors: list[BaseException] = []
    answered = 0
    per_turn = limits.max_turn_tokens or sampling.max_tokens
    for (k, stop, stop_ids, seed, share), requests in _plan(active, turn, sampling).items():
        ts = [t for _, group in requests for t in group]
        budget = max(
            min(
                per_turn,
                _settings(t).max_tokens or per_turn,
                limits.max_total_tokens - len(t.tokens),
            )
            for t in ts
        )
        params = attrs.evolve(
            sampling,
            n=k * share,
            max_tokens=max(budget, 1),
            stop=tuple(dict.fromkeys((*sampling.stop, *stop))),
            stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *stop_ids))),
            seed=turn_seed(sampling.seed, turn) if seed is None else seed,
        )
        engine_requests = [
            GenerationRequest(request_id=i, prompt_ids=prompt)
            for i, (prompt, _) in enumerate(requests)
        ]
        version = engine.weight_version
        results, failed = _isolated(_engine_call(engine, params, chunk_tokens, between),
                                    engine_requests)
        errors += [error for _, error in failed.values()]
        answered += len(engine_requests) - len(failed)
        for rid, (_, error) in failed.items():
            for t in requests[rid][1]:
                _fail_turn(t, error)
        answers: dict[int, list[Any]] = {}
        for res in sorted(results, key=lambda r: (r.request_id, r.index)):
            t = requests[res.request_id][1][res.index // k]
            answers.setdefault(id(t), [t]).append(res)
        for t, *choices in answers.values():
            branches += _keep(t, choices, tokenizer, turn, per_turn, version, limits, segments)
    if errors and not answered:  # every prompt failed: the engine's fault, not a request's
        raise errors[0]
    return branches


def _engine_call(engine: RolloutEngine, params: SamplingParams, chunk_tokens: int,
                 between: Callable[[], None]) -> Callable[[list[Any]], list[Any]]:
    """One turn's engine call on a list of requests, its results checked."""

    def run(batch: list[Any]) -> list[Any]:
        if chunk_tokens > 0:
            from peerflow.streaming.partial import generate_in_segments

            results = generate_in_segments(
                engine, batch, params, chunk_tokens=chunk_tokens, between_chunks=between
            )
        else:
            results = engine.generate(batch, params)
        return check_results(engine, results, len(batch), params.n)

    return run


def _isolated(run: Callable[[list[Any]], list[Any]], requests: list[Any]
              ) -> tuple[list[Any], dict[int, tuple[Any, BaseException]]]:
    """`run(requests)`; when it raises, each request alone.

    So one prompt the engine fails on ends only its own trajectories.

    Returns:
        The results, and the requests that failed alone by request id (with the error).
    """
    try:
        return run(requests), {}
    except Exception as exc:  # noqa: BLE001 — retried alone below
        if len(requests) == 1:
            return [], {requests[0].request_id: (requests[0], exc)}
    results, failed = [], {}
    for request in requests:
        try:
            results += run([request])
        except Exception as exc:  # noqa: BLE001 — this trajectory's turn fails, not the run
            failed[request.request_id] = (request, exc)
    return results, failed


def _fail_turn(t: Any, error: BaseException) -> None:
    """Ends `t` (`env_error`) because the engine could not sample its turn; tells its env."""
    message = (f"the rollout engine failed on this trajectory's prompt "
               f"({type(error).__name__}: {error})")
    t.end("env_error", message, failure_of(error))
    t.env.turn_failed(message)


def _keep(
    t: Any,
    choices: list[Any],
    tokenizer: Any,
    turn: int,
    per_turn: int,
    version: int,
    limits: Any,
    segments: Segments,
) -> list[Any]:
    """Appends choice 0 to `t`; the other choices become branch samples (returned)."""
    turn_room = min(per_turn, _settings(t).max_tokens or per_turn)
    base = t if len(choices) == 1 else attrs.evolve(  # the trajectory before this turn
        t, **{name: _copy(getattr(t, name)) for name in _CONTENT}, info=dict(t.info))
    turns, branches = [], []
    for k, res in enumerate(choices):
        target = (
            t
            if k == 0
            else attrs.evolve(base, **{name: _copy(getattr(base, name)) for name in _CONTENT})
        )
        total_room = limits.max_total_tokens - len(target.tokens)
        room = min(turn_room, total_room)
        ids = list(res.token_ids)
        versions = token_versions(res.version_segments, len(ids), version).tolist()
        add_turn_routes(target, res.routed_experts, len(ids[:room]))
        target.append(ids[:room], res.logprobs[:room], versions[:room], sampled=True)
        target.turns += 1
        ran_out = total_room < turn_room and (
            len(ids) > total_room or (res.finish_reason == "length" and len(ids) >= total_room)
        )
        turns.append(
            Turn(
                token_ids=ids[:room],
                index=turn,
                logprobs=res.logprobs[:room],
                text=tokenizer.decode(ids[:room], skip_special_tokens=True),
                truncated=len(ids) > room or res.finish_reason == "length",
            )
        )
        target.last_turn = turns[-1]
        if k:
            target.segment = segments.next(t.env)
            target.info = {**base.info, "segment": float(target.segment), "branches": 1.0}
            target.end("branch")
            branches.append(target)
        elif ran_out:
            t.end("max_tokens")
    t.last_turn = attrs.evolve(turns[0], alternatives=turns[1:])
    t.branches = branches
    return branches


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def swap_answers(t: Any, branch: Any) -> None:
    """Makes `branch`'s answer the trajectory's (`StepResult.choice`), and `t`'s the branch's.

    Both share every token before this turn, so their contents swap whole.
    """
    for name in _CONTENT:
        if name == "last_turn":
            continue
        a, b = getattr(t, name), getattr(branch, name)
        setattr(t, name, b)
        setattr(branch, name, a)
