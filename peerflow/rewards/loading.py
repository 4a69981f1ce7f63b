"""Reward functions named by a file or module path: `rewards.py:score`, `pkg.mod:score`.

`parse_target` tells a path reference from a registered reward name; `load_function`
imports the function (a file is loaded by path, its folder appended to `sys.path` so it
can import its neighbours); `reward_shape` reads how to call it from its signature:

* per sample: `fn(response, example) -> float | dict` (a dict carries `score` plus extra
  numeric metrics);
* batched: `fn(responses, examples) -> list` — the first parameter is named
  `responses`, `completions`, `solutions`, `texts` or `outputs`, or the config says
  `batched: true`;
* verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`, called with
  those keywords;
* TRL's `fn(completions, **kwargs) -> list` (`prompts`, `completion_ids` and every dataset
  column as keyword lists; `peerflow.rewards.trl_style`);
* any of them as `async def`.

Every problem is a `RewardLoadError` naming the config key, the file or module and — for
a missing function — the functions it does define.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from peerflow.errors import ConfigError
from peerflow.rewards.trl_style import is_trl_style, takes_environments

#: First-parameter names that mark a batched reward.
BATCH_PARAMETERS = ("responses", "completions", "solutions", "texts", "outputs")
#: Keywords of verl's `compute_score`.
VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardLoadError(ConfigError):
    """A reward reference names no loadable function, or one with an unusable signature."""


@attrs.frozen(kw_only=True)
class RewardTarget:
    """A reward function named by `path/to/file.py:function` or `package.module:function`."""

    source: str
    """Absolute path of a `.py` file, or a dotted module name."""
    function: str
    """Name of the function (dots allowed for `Class.method`)."""
    is_file: bool
    """Whether `source` is a file path."""

    @property
    def ref(self) -> str:
        """The `source:function` text worker processes load it from."""
        return f"{self.source}:{self.function}"


@attrs.frozen(kw_only=True)
class RewardShape:
    """How a reward function is called."""

    batched: bool = False
    """One call for all samples (`fn(responses, examples) -> list`)."""
    verl: bool = False
    """verl's keyword signature (`solution_str`, `ground_truth`, …)."""
    is_async: bool = False
    """An `async def` (run with `asyncio.run` in the worker)."""
    trl: bool = False
    """TRL's keyword form, called once per batch (`peerflow.rewards.trl_style`)."""
    environments: bool = False
    """TRL's `reward_func(environments, **kwargs)`: it reads the episodes' environment
    instances, so the episodes score it in the rollout process, never the reward pool."""


def parse_target(text: str, base_dir: str | Path | None = None) -> RewardTarget | None:
    """Returns the target named by `text`, or `None` when `text` is a registered name.

    `file.py:fn` (any text whose part before the last `:` ends in `.py` or contains a
    path separator) is a file, resolved against `base_dir` (default: the working
    directory); `pkg.mod:fn` is a module.
    """
    if ":" not in text:
        return None
    source, _, function = text.rpartition(":")
    if source.endswith(".py") or "/" in source or "\\" in source:
        path = Path(source).expanduser()
        if not path.is_absolute():
            path = Path(base_dir or Path.cwd()) / path
        return RewardTarget(source=str(path.resolve()), function=function, is_file=True)
    return RewardTarget(source=source, function=function, is_file=False)


def _import_source(target: RewardTarget, key: str) -> Any:
    if not target.is_file:
        try:
            return importlib.import_module(target.source)
        except ImportError as exc:
            raise RewardLoadError(
                f"{key}: cannot import module {target.source!r} ({exc}); install the package "
                "or name a file instead (path/to/rewards.py:function)."
            ) from None
    path = Path(target.source)
    if not path.is_file():
        raise RewardLoadError(
            f"{key}: reward file {str(path)!r} does not exist; give a .py file (relative "
            "paths are resolved from the working directory) followed by ':function'."
        )
    name = "peerflow_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"{key}: {str(path)!r} cannot be loaded as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything on import
        del sys.modules[name]
        raise RewardLoadError(
            f"{key}: importing reward file {str(path)!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _functions_of(module: Any) -> list[str]:
    return sorted(name for name, value in vars(module).items()
                  if callable(value) and not name.startswith("_")
                  and getattr(value, "__module__", None) == module.__name__)


def load_function(target: RewardTarget, key: str = "task.reward") -> Callable[..., Any]:
    """Imports the function `target` names.

    Raises:
        RewardLoadError: the file or module is missing or fails to import, or it has no
            callable of that name (the message lists the functions it does define).
    """
    module = _import_source(target, key)
    value: Any = module
    for part in target.function.split("."):
        value = getattr(value, part, None)
        if value is None:
            break
    if value is None or not callable(value):
        defined = _functions_of(module)
        close = difflib.get_close_matches(target.function, defined, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        where = "file" if target.is_file else "module"
        raise RewardLoadError(
            f"{key}: {where} {target.source!r} defines no function {target.function!r}.{hint} "
            f"It defines: {', '.join(defined) or '(no public functions)'}."
        )
    return value


def reward_shape(fn: Callable[..., Any], batched: bool | None = None,
                 key: str = "task.reward") -> RewardShape:
    """Reads how to call `fn` from its signature.

    Args:
        fn: The reward function.
        batched: Force the batched (`True`) or per-sample (`False`) form; `None` decides
            by the first parameter's name.
        key: Config key named in errors.

    Raises:
        RewardLoadError: `fn` cannot be called with two positional arguments (nor with
            verl's keywords).
    """
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return RewardShape(batched=bool(batched))
    is_async = inspect.iscoroutinefunction(fn)
    names = {p.name for p in params}
    if {"solution_str", "ground_truth"} <= names:
        return RewardShape(verl=True, is_async=is_async)
    if is_trl_style(params):
        return RewardShape(batched=True, trl=True, is_async=is_async,
                           environments=takes_environments(fn))
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_two = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    if not takes_two or len(required) > 2 or any(p.kind == p.KEYWORD_ONLY for p in required):
        raise RewardLoadError(
            f"{key}: reward {name}{inspect.signature(fn)} has the wrong signature; write "
            "`def score(response, example) -> float` (per sample), "
            "`def score(responses, examples) -> list[float]` (batched), verl's "
            "`compute_score(data_source, solution_str, ground_truth, extra_info)`, or TRL's "
            "`def score(completions, **kwargs) -> list[float]` (dataset columns by name)."
        )
    if batched is None:
        batched = bool(positional) and positional[0].name in BATCH_PARAMETERS
    return RewardShape(batched=batched, is_async=is_async)


def callable_target(fn: Callable[..., Any], key: str = "reward_fn") -> str:
    """Returns the `module:function` (or `file.py:function`) reference of a callable.

    Worker processes import rewards by reference, so the callable must be a module-level
    function of an importable module or file.

    Raises:
        RewardLoadError: a lambda, a nested function, or one defined in a notebook.
    """
    qualname = getattr(fn, "__qualname__", "")
    module_name = getattr(fn, "__module__", None)
    if not qualname or "<lambda>" in qualname or "<locals>" in qualname or not module_name:
        raise RewardLoadError(
            f"{key}: {fn!r} is a lambda or a function defined inside another function; worker "
            "processes import rewards by name, so define it at the top level of a .py file "
            "and pass that function (or 'path/to/file.py:name')."
        )
    module = sys.modules.get(module_name)
    if module_name == "__main__" or module_name.startswith("peerflow_reward_"):
        path = getattr(module, "__file__", None)
        if not path or not Path(path).is_file():  # a notebook, a REPL or `python -`
            raise RewardLoadError(
                f"{key}: {qualname!r} is defined in an interactive session (notebook, "
                "REPL or standard input), which worker processes cannot import; move it "
                "into a .py file and pass 'path/to/file.py:" + qualname + "' or the "
                "imported function."
            )
        return f"{Path(path).resolve()}:{qualname}"
    return f"{module_name}:{qualname}"
