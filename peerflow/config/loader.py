"""Reading, overriding and validating run configs."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from peerflow.config.extras import dependency_problems
from peerflow.config.paths import resolve_paths
from peerflow.config.refusals import capability_problems
from peerflow.config.schema import RunConfig
from peerflow.config.structure import apply_override, structure, unstructure
from peerflow.errors import ConfigError, PeerFlowError


def load_raw(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Reads a YAML file (or starts empty) and applies `--set` overrides.

    Relative paths become absolute: the file's from its directory, the overrides' from
    the working directory (`peerflow.config.paths`).

    Raises:
        ConfigError: the file is missing, is not YAML, or is not a mapping.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections.")
        data = resolve_paths(loaded or {}, path.parent)
    for assignment in overrides:
        apply_override(data, assignment)
    return resolve_paths(data, Path.cwd())


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *,
                problems: list[str] | None = None) -> RunConfig:
    """Returns the typed `RunConfig` of a YAML file plus overrides (structure only).

    Call `validate_config` afterwards to check names against the installed plugins.
    With `problems`, structure problems are appended there instead of raised, and the
    keys that failed keep their defaults (see `peerflow.config.structure.structure`).
    """
    return structure(RunConfig, load_raw(path, overrides), problems=problems)


def dump_config(config: RunConfig) -> str:
    """Returns the resolved config as YAML (what a run directory records)."""
    return yaml.safe_dump(unstructure(config), sort_keys=False)


def structure_options(cls: type, section: Any, key: str) -> Any:
    """Validates one adapter's or component's option section against its options class."""
    return structure(cls, section or {}, key)


def _check_name(pm: Any, kind: str, name: str, problems: list[str]) -> type | None:
    registry = pm.registry(kind)
    if name not in registry:
        problems.append(registry.unknown_message(name))
        return None
    return registry.get(name)


def _check_engine(pm: Any, kind: str, section: Any, key: str,
                  problems: list[str]) -> type | None:
    registry = pm.registry(kind)
    for name in section.engine_options:
        if name not in registry:
            choices = [f.name for f in attrs.fields(type(section)) if f.name != "engine_options"]
            close = difflib.get_close_matches(name, choices + registry.names(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(
                f"{key}.{name}: unknown key.{hint} Valid keys: {', '.join(choices)}, or an "
                f"options section named after a backend ({', '.join(registry.names())})."
            )
    cls = _check_name(pm, kind, section.backend, problems)
    if cls is None:
        return None
    try:
        structure_options(cls.options_class, section.engine_options.get(section.backend),
                          f"{key}.{section.backend}")
    except ConfigError as exc:
        problems.append(str(exc))
    return cls


def _check_agent(pm: Any, agent: Any, problems: list[str]) -> None:
    """Checks `rollout.agent`: a registered environment and its options."""
    if agent is None:
        return
    env_cls = _check_name(pm, "environment", agent.environment, problems)
    if env_cls is None:
        return
    try:
        structure_options(env_cls.options_class, agent.options, "rollout.agent.options")
    except ConfigError as exc:
        problems.append(str(exc))


def validate_config(config: RunConfig, pm: Any) -> None:
    """Checks every name and option section against the installed plugins.

    Also refused here, before any process starts: a setting the selected engines cannot
    do (`peerflow.config.refusals`, from their `Capabilities`, and what the engines' own
    `config_problems` find) and one whose optional library is not installed
    (`peerflow.config.extras`, naming the extra to install).

    Args:
        config: A structured config.
        pm: The `peerflow.plugins.PluginManager` of this process.

    Raises:
        ConfigError: listing every problem found, each naming the key and the fix.
    """
    problems: list[str] = []
    for kind, section in (("rollout_engine", "rollout"), ("train_engine", "trainer")):
        engine = _check_engine(pm, kind, getattr(config, section), section, problems)
        if engine is not None:
            problems += engine.config_problems(config)
    task_cls = _check_name(pm, "task", config.task.name, problems)
    if task_cls is not None:
        try:
            structure_options(task_cls.options_class, config.task.options, "task.options")
        except ConfigError as exc:
            problems.append(str(exc))
    _check_agent(pm, config.rollout.agent, problems)
    problems += dependency_problems(config, pm) + capability_problems(config, pm)
    estimator = _check_name(pm, "advantage_estimator", config.algorithm.advantage, problems)
    loss = _check_name(pm, "policy_loss", config.algorithm.loss, problems)
    known = {c.name: c for c in (estimator, loss) if c is not None}
    for name, section in config.algorithm.options.items():
        if name not in known:
            problems.append(
                f"algorithm.options.{name}: no selected estimator or loss is called {name!r}; "
                f"option sections here are named after algorithm.advantage "
                f"({config.algorithm.advantage!r}) or algorithm.loss ({config.algorithm.loss!r})."
            )
            continue
        try:
            structure_options(known[name].options_class, section, f"algorithm.options.{name}")
        except ConfigError as exc:
            problems.append(str(exc))
    arguments = {"config": config, "pm": pm}
    for impl in pm.hook.peerflow_validate_config.get_hookimpls():  # one failing check
        try:                                                       # hides no other
            problems += impl.function(*(arguments[a] for a in impl.argnames)) or []
        except PeerFlowError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
