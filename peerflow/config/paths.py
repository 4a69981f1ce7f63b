"""Relative paths in a run config: from the config file's directory, or the working one.

A config names files: `model.path`, the task's data (`task.options` keys named `path` or
ending in `_path`, `_file`, `_dir`: the dataset task's `path` and `eval_path`), reward
functions by file (`task.reward`, `task.rewards[].fn`, a workflow node's `options.reward`:
`path/to/rewards.py:function`) and an MLflow store directory
(`run.trackers.mlflow.tracking_uri` without a `scheme:`).
A relative one **in the file** resolves from the file's directory, so a config works from
any working directory and next to its data; one given **with `--set`** resolves from the
working directory, where the shell that typed it is. Both become absolute before anything
else reads them (the run directory records them so). `~` expands; registered names and
`package.module:function` references are not paths and stay as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_FILE_FUNCTION = re.compile(r"^(?P<file>.+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")
_PATH_OPTION = re.compile(r"^(path|.+_(path|file|dir))$")


def _absolute(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value:
        return value
    path = Path(value).expanduser()
    return value if value == str(path) and path.is_absolute() else str(base / path)


def _function_file(value: Any, base: Path) -> Any:
    match = _FILE_FUNCTION.match(value) if isinstance(value, str) else None
    if match is None:
        return value
    return f"{_absolute(match['file'], base)}:{match['function']}"


def _update(section: Any, key: str, fix: Callable[[Any], Any]) -> None:
    if isinstance(section, dict) and key in section:
        section[key] = fix(section[key])


def resolve_paths(data: dict[str, Any], base: str | Path) -> dict[str, Any]:
    """Makes every relative path of plain config `data` absolute from `base`, in place.

    Args:
        data: Plain config data (as read from YAML, overrides applied or not).
        base: The directory relative paths start from.

    Returns:
        `data`.
    """
    base = Path(base).expanduser().absolute()
    _update(data.get("model"), "path", lambda v: _absolute(v, base))
    task = _section(data, "task")
    if task is not None:
        _update(task, "reward", lambda v: _function_file(v, base))
        for entry in task.get("rewards") or []:
            _update(entry, "fn", lambda v: _function_file(v, base))
        options = task.get("options")
        if isinstance(options, Mapping):
            for key in [k for k in options if _PATH_OPTION.match(str(k))]:
                _update(options, key, lambda v: _absolute(v, base))
    for node in _section(data, "workflow", "nodes") or []:
        _update(_section(node, "options"), "reward", lambda v: _function_file(v, base))
    _update(_section(data, "run", "trackers", "mlflow"), "tracking_uri",
            lambda v: _local_directory(v, base))
    return data


def _section(data: Any, *keys: str) -> Any:
    """`data[k1][k2]…`, or `None` where a level is missing or not a mapping."""
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _local_directory(value: Any, base: Path) -> Any:
    """A tracking URI that is a plain directory (no `scheme:`), made absolute."""
    return value if not isinstance(value, str) or ":" in value else _absolute(value, base)
