"""Building a run's `RewardSet` from `task.reward` / `task.rewards`, and checking it early.

`check_rewards` is a config validator (`peerflow.config.EXTRA_VALIDATORS`): it imports
every referenced file or module and reads each function's signature in the launching
process, so a typo in a path or a function name, or an unusable signature, is reported
before any worker starts.
"""

from __future__ import annotations

from typing import Any

from peerflow.errors import ConfigError
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
    components = [_component(key, entry, pm) for key, entry in entries]
    limits = task.reward_limits
    if pool is None and limits.workers > 0 and any(c.ref for c in components):
        pool = RewardPool(workers=limits.workers, timeout_s=limits.timeout_s,
                          memory_mb=limits.memory_mb)
    return RewardSet(components=components, failure_score=limits.failure_score, pool=pool)


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
    registry = pm.registry("task")
    default = None
    if config.task.name in registry:
        default = getattr(registry.get(config.task.name), "default_reward", None)
    names = []
    for key, entry in reward_entries(config.task, default):
        if parse_target(entry.fn) is None and entry.fn not in pm.registry("reward"):
            problems.append(pm.registry("reward").unknown_message(entry.fn) + (
                " Or name a function: task.reward: path/to/rewards.py:function"))
            continue
        try:
            names.append(_component(key, entry, pm).name)
        except ConfigError as exc:
            problems.append(str(exc))
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"task.rewards: several rewards are named {duplicates}; give each a "
                        "distinct `name` (its metrics are reward/<name>/...).")
    return problems
