"""A pool of reward worker processes with a per-call time limit and a memory limit.

Built on `pebble.ProcessPool`: a call that runs past `timeout_s` has its worker process
killed and replaced (a plain `concurrent.futures` pool cannot stop a running call), and
a worker that dies (segfault, the kernel's OOM killer) fails only the call it was running.
Workers are started with `spawn`, so they are fresh interpreters that never inherit the
trainer's memory or threads, and each caps its address space with
`resource.setrlimit(RLIMIT_AS)`: an allocation past `memory_mb` raises `MemoryError`
inside the reward instead of swapping the machine.

`RewardPool.submit` returns futures of `list[Outcome]`; `Outcome.status` is `ok`,
`error` or `timeout`, so the caller never waits forever and never mistakes a failure for
a score.

Each call marks its deadline (`peerflow.rewards.deadline`), so a reward that runs
sandboxed programs ends them before it (the `code` reward: a program out of time is a
wrong answer). A worker stopped past its deadline (pebble sends SIGTERM, then SIGKILL
three seconds later) unwinds the call first: the sandbox kills its program's processes
and removes its directory and cgroup, then the worker exits.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import math
import multiprocessing
import os
import resource
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

import attrs

from peerflow.rewards import deadline
from peerflow.rewards.loading import (
    VERL_PARAMETERS,
    RewardShape,
    load_function,
    parse_target,
    reward_shape,
)
from peerflow.rewards.trl_style import call_trl, logged_means


@attrs.frozen(kw_only=True)
class Outcome:
    """What one sample's reward call came to."""

    status: Literal["ok", "error", "timeout"]
    score: float = 0.0
    """The score (only meaningful when `status` is `ok`)."""
    extras: dict[str, float] = attrs.field(factory=dict)
    """Extra numeric metrics the reward returned next to `score`."""
    message: str = ""
    """Why it failed (exception type and message)."""
    traceback: str = ""
    """The reward's traceback when it raised (kept in `RUN_DIR/reward_errors.jsonl`)."""


def to_outcome(value: Any, name: str) -> Outcome:
    """Turns a reward's return value (number, bool, or dict with `score`) into an Outcome."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return Outcome(status="error", message=(
                f"reward {name!r} returned a dict without 'score' (keys: {sorted(value)}); "
                "return a number or {'score': number, ...}"))
        extras = {str(k): float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, (int, float, bool))}
        value = value["score"]
    if isinstance(value, (int, float, bool)) or hasattr(value, "__float__"):
        score = float(value)
        if math.isfinite(score):
            return Outcome(status="ok", score=score, extras=extras)
        return Outcome(status="error", message=(
            f"reward {name!r} returned {score} (a failure: the sample scores "
            "task.reward_limits.failure_score and task.reward_limits.on_failure decides "
            "whether it is trained)"))
    return Outcome(status="error", message=(
        f"reward {name!r} returned {type(value).__name__} {value!r:.80}; return a number or "
        "{'score': number, ...}"))


_LOADED: dict[str, tuple[Callable[..., Any], RewardShape]] = {}


def _loaded(ref: str, batched: bool | None) -> tuple[Callable[..., Any], RewardShape]:
    key = f"{ref}|{batched}"
    if key not in _LOADED:
        target = parse_target(ref)
        if target is None:
            raise ValueError(f"{ref!r} is not a 'source:function' reward reference")
        fn = load_function(target)
        _LOADED[key] = (fn, reward_shape(fn, batched))
    return _LOADED[key]


def _invoke(fn: Callable[..., Any], shape: RewardShape, response: Any, example: Any) -> Any:
    if shape.verl:
        accepted = inspect.signature(fn).parameters
        values = {"data_source": example.get("data_source"), "solution_str": response,
                  "ground_truth": example.get("answer"),
                  "extra_info": example.get("extra_info")}
        result = fn(**{k: values[k] for k in VERL_PARAMETERS if k in accepted})
    else:
        result = fn(response, example)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


class Stopped(BaseException):
    """Raised in a worker by the pool's SIGTERM, to unwind (and clean up) the call."""


def _stop(signum: int, frame: Any) -> None:
    if deadline.seconds_left() is None:  # idle: nothing to clean up
        os._exit(128 + signum)
    raise Stopped()


def call_reward(ref: str, batched: bool | None, responses: Sequence[Any],
                examples: Sequence[dict[str, Any]], context: dict[str, Any] | None = None,
                timeout_s: float | None = None) -> list[Outcome]:
    """Runs in a pool worker: scores `responses` with the function `ref` names.

    Per-sample rewards are called once per response; a batched reward once for all (a
    TRL-style one with keyword lists, `context` giving `completion_ids`, `step` and
    `steps`). Exceptions propagate (the pool reports them); bad return values become
    `error` outcomes naming the reward. `timeout_s` is the call's time limit (its
    deadline for `peerflow.rewards.deadline`); a `Stopped` call exits the worker once
    its clean-up has run.
    """
    deadline.start(timeout_s)
    try:
        return _call_reward(ref, batched, responses, examples, context)
    except Stopped:
        os._exit(128 + signal.SIGTERM)
    finally:
        deadline.start(None)


def _call_reward(ref: str, batched: bool | None, responses: Sequence[Any],
                 examples: Sequence[dict[str, Any]], context: dict[str, Any] | None
                 ) -> list[Outcome]:
    fn, shape = _loaded(ref, batched)
    name = ref.rpartition(":")[2]
    if not shape.batched:
        return [to_outcome(_invoke(fn, shape, r, e), name) for r, e in zip(responses, examples)]
    extras: dict[str, float] = {}
    if shape.trl:
        values, logged = call_trl(fn, responses, examples, context)
    else:
        values = fn(list(responses), list(examples))
    if asyncio.iscoroutine(values):
        values = asyncio.run(values)
    values = list(values)
    if shape.trl:  # TRL's None: this reward does not apply to the sample (adds 0)
        values = [0.0 if v is None else v for v in values]
        extras = logged_means(logged)
    if len(values) != len(responses):
        raise ValueError(f"batched reward {name!r} returned {len(values)} scores for "
                         f"{len(responses)} responses; return one per response")
    outcomes = [to_outcome(v, name) for v in values]
    return [attrs.evolve(o, extras={**extras, **o.extras}) if extras and o.status == "ok"
            else o for o in outcomes]


def _init_worker(memory_bytes: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    signal.signal(signal.SIGTERM, _stop)
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def user_traceback(text: str) -> str:
    """A reward's traceback from its own first frame on (pebble's and PeerFlow's left out)."""
    import pebble

    import peerflow

    ours = tuple(os.path.dirname(m.__file__) for m in (pebble, peerflow))
    lines = text.rstrip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith('  File "') and not line[len('  File "'):].startswith(ours):
            return "\n".join([lines[0], *lines[i:]])
    return "\n".join(lines)


def failed(exc: BaseException, timeout_s: float, memory_mb: int) -> Outcome:
    """The `Outcome` of a call that raised `exc` (as the pool reports it)."""
    from pebble import ProcessExpired

    if isinstance(exc, FutureTimeout):
        return Outcome(status="timeout", message=f"timed out after {timeout_s:g} s")
    if isinstance(exc, MemoryError):
        return Outcome(status="error",
                       message=f"MemoryError (over the {memory_mb} MiB memory limit)")
    if isinstance(exc, ProcessExpired):
        return Outcome(status="error", message=f"the reward process died (exit code "
                       f"{exc.exitcode}; memory limit {memory_mb} MiB)")
    return Outcome(status="error", message=f"{type(exc).__name__}: {exc}",
                   traceback=user_traceback(str(getattr(exc, "traceback", "") or "")))


@attrs.define(eq=False)
class RewardPool:
    """Worker processes that run reward calls under a time and a memory limit.

    Args:
        workers: Processes in the pool.
        timeout_s: Wall-clock limit of one call (one sample, or one batched call).
        memory_mb: Address-space limit of each worker (0: none).
    """

    workers: int = 2
    timeout_s: float = 30.0
    memory_mb: int = 4096
    _pool: Any = attrs.field(default=None, init=False)

    def _started(self) -> Any:
        if self._pool is None:
            from pebble import ProcessPool

            self._pool = ProcessPool(
                max_workers=self.workers, context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self.memory_mb * 2**20,))
            # pebble's workers are not daemonic: a process that exits with the pool open
            # waits for them (multiprocessing joins its children), so owners call close();
            # atexit covers a plain interpreter exit.
            atexit.register(self.close)
        return self._pool

    def submit(self, ref: str, batched: bool | None, responses: Sequence[Any],
               examples: Sequence[dict[str, Any]], context: dict[str, Any] | None = None
               ) -> Future:
        """Schedules one call; its future yields `list[Outcome]` or raises."""
        return self._started().schedule(
            call_reward, args=(ref, batched, list(responses), list(examples), context,
                               self.timeout_s),
            timeout=self.timeout_s)

    def outcomes(self, future: Future, count: int) -> list[Outcome]:
        """Waits for a submitted call; a failure becomes `count` failed outcomes."""
        try:
            return future.result()
        except BaseException as exc:  # noqa: BLE001 - every failure is scored, none hangs
            if isinstance(exc, KeyboardInterrupt):
                raise
            return [failed(exc, self.timeout_s, self.memory_mb)] * count

    def close(self) -> None:
        """Stops the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None
