"""Building a run's `RewardSet` from `task.reward` / `task.rewards`, and checking it early.

`check_rewards` is a config validator (this module, a core plugin, registers it as
`peerflow_validate_config`): it imports
every referenced file or module and reads each function's signature in the launching
process, so a typo in a path or a function name, or an unusable signature, is reported
before any worker starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from peerflow.errors import ConfigError
from peerflow.plugins.hookspecs import hookimpl
from peerflow.rewards.loading import load_function, parse_target, reward_shape
from peerflow.rewards.pool import RewardPool
from peerflow.rewards.scoring import RewardComponent, RewardSet


def reward_entries(task: Any, default: str | None) -> list[tuple[str, Any]]:
    """Returns `(config key, RewardEntry)` for every reward the task config selects."""
    from peerflow.config.schema import RewardEntry

    if task.rewards:
        return [(f"task.rewards[{i}].fn", e) for i, e in enumerate(task.rewards)]
    name = task.reward or default
    return [("task.reward", RewardEntry(fn=name))] if name else []


def selected_rewards(config: Any, pm: Any) -> list[tuple[str, Any]]:
    """`reward_entries` of a run config, with its task's `default_reward` when it names none."""
    registry = pm.registry("task")
    default = None
    if config.task.name in registry:
        default = getattr(registry.get(config.task.name), "default_reward", None)
    return reward_entries(config.task, default)


def _component(key: str, entry: Any, pm: Any) -> RewardComponent:
    target = parse_target(entry.fn)
    name = entry.name or (entry.fn if target is None else target.function.rpartition(".")[2])
    if target is None:
        cls = pm.get("reward", entry.fn)
        ref = getattr(cls, "function", None)
        if ref is None:
            from peerflow.config import structure_options

            options = structure_options(getattr(cls, "options_class", object), {},
                                        f"reward {entry.fn}")
            return RewardComponent(name=name, weight=entry.weight, function=cls(options))
        target = parse_target(ref)
        assert target is not None, f"{cls.__name__}.function must be 'module:function'"
    fn = load_function(target, key)
    return RewardComponent(name=name, weight=entry.weight, ref=target.ref,
                           shape=reward_shape(fn, entry.batched, key))


def build_reward_set(task: Any, pm: Any, default: str | None, name: str | None = None,
                     pool: RewardPool | None = None) -> RewardSet:
    """Builds the rewards of a run.

    Args:
        task: `config.task` (`TaskConfig`).
        pm: The plugin manager (registered reward classes).
        default: The task's own reward name, used when the config names none.
        name: One reward to use instead (a workflow node's `options.reward`).
        pool: The pool for function rewards; `None` makes one from `task.reward_limits`
            (or none when `workers` is 0).
    """
    from peerflow.config.schema import RewardEntry

    entries = [("workflow node options.reward", RewardEntry(fn=name))] if name else (
        reward_entries(task, default))
    components = [c for c in (_component(key, entry, pm) for key, entry in entries)
                  if not (c.shape and c.shape.environments)]  # the episodes score those
    limits = task.reward_limits
    if pool is None and limits.workers > 0 and any(c.ref for c in components):
        pool = RewardPool(workers=limits.workers, timeout_s=limits.timeout_s,
                          memory_mb=limits.memory_mb)
    return RewardSet(components=components, failure_score=limits.failure_score, pool=pool,
                     on_failure=limits.on_failure)


@attrs.frozen(kw_only=True)
class EpisodeReward:
    """A task reward written TRL's way, `reward_func(environments, **kwargs)`.

    It reads the episodes' environment instances, so each episode calls it in the rollout
    process (`Environment.scores_environment_rewards`); the reward pool never does.
    """

    name: str
    """Its reward component (`reward/<name>/mean`)."""
    weight: float = 1.0
    function: Callable[..., Any]
    """The loaded function."""


def episode_rewards(config: Any, pm: Any) -> list[EpisodeReward]:
    """The task's rewards that read TRL's `environments` (empty when none do)."""
    found = []
    for key, entry in selected_rewards(config, pm):
        target = parse_target(entry.fn)
        if target is None:
            continue
        fn = load_function(target, key)
        if reward_shape(fn, entry.batched, key).environments:
            component = _component(key, entry, pm)
            found.append(EpisodeReward(name=component.name, weight=entry.weight, function=fn))
    return found


def _episode_reward_problems(config: Any, pm: Any, names: list[str],
                             others: list[str]) -> list[str]:
    """`environments` rewards need an environment whose episodes score them, alone."""
    agent = config.rollout.agent
    registry = pm.registry("environment")
    env_cls = registry.get(agent.environment) if (
        agent is not None and agent.environment in registry) else None
    if names and others:  # the episodes' reward would leave the others unused, silently
        return [f"task.rewards: {', '.join(repr(n) for n in names)} read TRL's "
                f"`environments` and {', '.join(repr(n) for n in others)} do not; an "
                "episode's environment reward replaces the task's other rewards, so they "
                "would never run. Read everything in one reward_func(environments, "
                "completions, **kwargs), or score the class with get_reward()."]
    if not names or getattr(env_cls, "scores_environment_rewards", False):
        return []
    where = ("this run has no rollout.agent" if agent is None else
             f"rollout.agent.environment {agent.environment!r} has no such instances")
    return [f"task.reward: {', '.join(repr(n) for n in names)} read TRL's `environments` "
            f"(the environment_factory instances), and {where}. Run the class with "
            "rollout.agent.environment: environment-factory (rollout.agent.options.factory: "
            "path/to/env.py:Cls), where such a reward scores each episode; or let the class "
            "own its reward: define get_reward() (or set self.reward) and drop task.reward."]


def check_rewards(config: Any, pm: Any) -> list[str]:
    """Config validator: every reward loads and has a usable signature; sane limits."""
    problems: list[str] = []
    limits = config.task.reward_limits
    if limits.workers < 0 or limits.timeout_s <= 0 or limits.memory_mb < 0:
        problems.append(
            f"task.reward_limits: workers={limits.workers}, timeout_s={limits.timeout_s}, "
            f"memory_mb={limits.memory_mb}; need workers ≥ 0, timeout_s > 0, memory_mb ≥ 0."
        )
    if limits.memory_mb and limits.memory_mb < 256:
        problems.append(f"task.reward_limits.memory_mb={limits.memory_mb} is too small for a "
                        "Python process; give at least 256 (or 0 for no limit).")
    names, reading = [], []
    for key, entry in selected_rewards(config, pm):
        if parse_target(entry.fn) is None and entry.fn not in pm.registry("reward"):
            problems.append(pm.registry("reward").unknown_message(entry.fn) + (
                " Or name a function: task.reward: path/to/rewards.py:function"))
            continue
        try:
            component = _component(key, entry, pm)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        names.append(component.name)
        if component.shape and component.shape.environments:
            reading.append(component.name)
    problems += _episode_reward_problems(config, pm, reading,
                                         [n for n in names if n not in reading])
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"task.rewards: several rewards are named {duplicates}; give each a "
                        "distinct `name` (its metrics are reward/<name>/...).")
    return problems


def check_reward_columns(config: Any, pm: Any, example: Any) -> list[str]:
    """TRL-style rewards get every keyword they require from the dataset's rows.

    Called by the preflight with the task's first training example; each required
    parameter of a TRL-style reward must be one of TRL's own arguments or a column.
    """
    from peerflow.rewards.scoring import example_record
    from peerflow.rewards.trl_style import PROVIDED, columns, missing_keywords

    available = columns([example_record(example)])
    problems = []
    for key, entry in selected_rewards(config, pm):
        target = parse_target(entry.fn)
        if target is None:
            continue
        fn = load_function(target, key)
        if not reward_shape(fn, entry.batched, key).trl:
            continue
        missing = missing_keywords(fn, available)
        if missing:
            problems.append(
                f"{key}: TRL-style reward {target.function}() requires "
                f"{', '.join(repr(m) for m in missing)}, which is neither one of the "
                f"arguments every call gets ({', '.join(PROVIDED)}) nor a column of the "
                f"task's rows ({', '.join(available) or 'none'}). Rename the parameter to "
                "a column, give it a default, or add the column to the dataset.")
    return problems


@hookimpl
def peerflow_validate_config(config: Any, pm: Any) -> list[str]:
    """Every reward loads, with a usable signature, before spawn (`check_rewards`)."""
    return check_rewards(config, pm)
