"""TRL-style reward functions: `def r(completions, ground_truth, **kwargs) -> list[float]`.

TRL's `GRPOTrainer` calls each reward function once per batch with keyword arguments
only, every one a list over the batch: `prompts`, `completions`, `completion_ids`, each
other dataset column by its own name, plus `trainer_state`, `log_extra` and `log_metric`
(`trl/trainer/grpo_trainer.py`, `_calculate_rewards`). PeerFlow passes the same:

* `prompts` — each sample's prompt (text, or its `{role, content}` messages);
* `completions` — the decoded answers; for chat prompts each is
  `[{"role": "assistant", "content": text}]`, as TRL gives them;
* `completion_ids` — the answers' token ids;
* every column of the sample's dataset row but the prompt (`answer` and `index` too);
* `trainer_state` — a `TrainerStateView` with `global_step` and `max_steps`;
* `log_metric(name, value)` — logged as `reward/<reward name>/<name>`.

`log_extra` is not passed. `environments` — TRL's `environment_factory` instances, one
per sample (`def reward_func(environments, **kwargs): return [e.reward for e in
environments]`) — exists only where those instances live: such a reward runs in the
episode's rollout process with `rollout.agent.environment: environment-factory` (each
episode scores itself, `environments` a list of one), and is refused at validate with any
other environment (`peerflow.rewards.setup`). A `None` in the returned list scores 0
(TRL drops it from the sum, which adds 0 as well). A function that needs a keyword no
row provides is refused before the run starts (`missing_keywords`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import attrs

#: What every call provides beside the dataset columns.
PROVIDED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric")
#: Parameter names only a TRL-style function has.
MARKERS = frozenset({"prompts", "completion_ids", "trainer_state", "log_metric", "log_extra",
                     "environments"})
#: The keyword of TRL's environment instances (`environment_factory`).
ENVIRONMENTS = "environments"


@attrs.frozen(kw_only=True)
class TrainerStateView:
    """What a TRL reward reads from `trainer_state` (a subset of `transformers.TrainerState`)."""

    global_step: int = 0
    """Optimizer steps done before this batch (the step being sampled, minus one)."""
    max_steps: int = 0
    """`run.steps`."""


def is_trl_style(params: Sequence[inspect.Parameter]) -> bool:
    """Whether a signature is TRL's: keyword arguments over the batch.

    It is when it names one of TRL's own arguments (`prompts`, `completion_ids`,
    `trainer_state`, `log_metric`, `log_extra`), or takes `**kwargs` with `completions`
    (or nothing) first — PeerFlow's `(response, example)` and `(responses, examples)`
    forms keep their meaning even with a `**kwargs`.
    """
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if MARKERS & set(names):
        return True
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        return False
    if len(names) >= 2 and names[1] in ("example", "examples"):
        return False
    return not names or names[0] == "completions"


def takes_environments(fn: Callable[..., Any]) -> bool:
    """Whether `fn` reads TRL's environment instances (a parameter `environments`)."""
    try:
        return ENVIRONMENTS in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def columns(records: Sequence[dict[str, Any]]) -> list[str]:
    """The dataset columns passed by name: every key of the rows but `prompt`, in order."""
    return list(dict.fromkeys(k for r in records for k in r if k != "prompt"))


def missing_keywords(fn: Callable[..., Any], available: Sequence[str]) -> list[str]:
    """The required parameters of `fn` that no call provides (neither TRL's nor a column)."""
    params = inspect.signature(fn).parameters.values()
    known = {*PROVIDED, ENVIRONMENTS, *available}  # environments: checked at validate
    return [p.name for p in params if p.default is p.empty and p.name not in known
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def call_trl(fn: Callable[..., Any], responses: Sequence[str],
             records: Sequence[dict[str, Any]], context: dict[str, Any] | None
             ) -> tuple[Any, dict[str, float]]:
    """Calls a TRL-style reward on a batch.

    Args:
        fn: The reward function.
        responses: Decoded answers.
        records: Each answer's dataset row (`example_record`).
        context: `completion_ids` (one list per answer), `step` and `steps`;
            `environments` (one instance per answer) for rewards that read them.

    Returns:
        What `fn` returned (a list, or an awaitable of one), and the means of what it
        logged through `log_metric`.
    """
    context = context or {}
    logged: dict[str, list[float]] = {}
    chat = [isinstance(r.get("prompt"), list) for r in records]
    kwargs: dict[str, Any] = {key: [r.get(key) for r in records] for key in columns(records)}
    kwargs.update(
        prompts=[r.get("prompt") for r in records],
        completions=[[{"role": "assistant", "content": text}] if is_chat else text
                     for text, is_chat in zip(responses, chat)],
        completion_ids=list(context.get("completion_ids") or [[] for _ in responses]),
        trainer_state=TrainerStateView(global_step=max(int(context.get("step", 1)) - 1, 0),
                                       max_steps=int(context.get("steps", 0))),
        log_metric=lambda name, value: logged.setdefault(str(name), []).append(float(value)),
    )
    if ENVIRONMENTS in context:
        kwargs[ENVIRONMENTS] = list(context[ENVIRONMENTS])
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        accepted = {p.name for p in params}
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    values = fn(**kwargs)
    return values, logged


def logged_means(logged: dict[str, list[float]]) -> dict[str, float]:
    """The mean of each metric a reward logged through `log_metric`."""
    return {name: sum(values) / len(values) for name, values in logged.items() if values}
