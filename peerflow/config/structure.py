"""Strict, typed conversion between plain YAML data and attrs config classes.

Unknown keys are errors with a did-you-mean; values are converted to the field's type
(`"1e-3"` becomes a float for a float field); every error names the dotted key path, and
every problem of a config is reported at once (one line each).
"""

from __future__ import annotations

import contextlib
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

import attrs
import yaml

from peerflow.engines.settings import DERIVED
from peerflow.errors import ConfigError

#: Field metadata key: unknown keys of the class are collected into this dict field
#: (engine sections such as `rollout.vllm: {...}`) instead of being rejected; they are
#: validated later against the registered backends.
SECTIONS = "peerflow_sections"


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str, problems: list[str] | None = None) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {_describe(value)} "
                          f"matches none of {' | '.join(_type_name(a) for a in args)}")
    if origin is typing.Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}: {value!r} is not one of {list(args)}.{hint}")
    if attrs.has(tp):
        return structure(tp, value, path, problems=problems)
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {_describe(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_each([(v, a, f"{path}[{i}]")
                                for i, (v, a) in enumerate(zip(value, args))]))
        item = args[0] if args else Any
        items = _each([(v, item, f"{path}[{i}]") for i, v in enumerate(value)])
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {_describe(value)}")
        vt = args[1] if args else Any
        keys = [str(k) for k in value]
        return dict(zip(keys, _each([(v, vt, f"{path}.{k}") for k, v in zip(keys,
                                                                         value.values())])))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}: expected true or false, got {_describe(value)}")
    if tp is int or tp is float:
        return _number(value, tp, path)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {_describe(value)}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: cannot read {_describe(value)} as {_type_name(tp)}")


def _each(items: list[tuple[Any, Any, str]]) -> list[Any]:
    """Converts every `(value, type, path)`, raising one error with every item's problem."""
    out, problems = [], []
    for value, tp, path in items:
        try:
            out.append(_convert(value, tp, path))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def _number(value: Any, tp: type[int] | type[float], path: str) -> int | float:
    """Reads an `int` (a whole float too) or a `float`; strings are parsed."""
    number = value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = tp(value)
    if isinstance(number, int | float) and not isinstance(number, bool):
        if tp is float:
            return float(number)
        if isinstance(number, int) or number.is_integer():
            return int(number)
    expected = "an integer" if tp is int else "a number"
    raise ConfigError(f"{path}: expected {expected}, got {_describe(value)}")


def structure(cls: type, data: Any, path: str = "", *,
              problems: list[str] | None = None) -> Any:
    """Builds an attrs config instance from plain data, strictly.

    Every problem is reported at once: each unknown key, type error and validator failure
    of the whole (nested) data, one line each, in one `ConfigError`.

    Args:
        cls: An attrs class whose fields have type annotations.
        data: A mapping (from YAML) or `None` for all defaults.
        path: Dotted key path of `data`, for messages.
        problems: Where given, problems are appended to it instead of raised, and the
            instance is built with defaults for the keys that failed (so later checks can
            run on the rest: `config validate` reports everything at once).

    Raises:
        ConfigError: an unknown key (with a did-you-mean), a missing required key, a
            value of the wrong type, or a validator failure — naming the key path.
    """
    where = path or "config"
    if data is None:
        data = {}
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} options, got "
                          f"{_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls)}
    sections_field = next((f.name for f in fields.values() if f.metadata.get(SECTIONS)), None)
    kwargs: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    found: list[str] = []
    for key, value in data.items():
        key = str(key)
        sub = f"{path}.{key}" if path else key
        if key in fields and fields[key].metadata.get(DERIVED):
            found.append(f"{sub}: not a setting; the runtime derives it from "
                         f"{fields[key].metadata[DERIVED]} (remove it).")
        elif key in getattr(cls, "renamed_keys", {}):
            found.append(f"{sub}: renamed; {cls.renamed_keys[key]}")
        elif key in fields and key != sections_field:
            try:
                kwargs[key] = _convert(value, hints[key], sub, problems)
            except ConfigError as exc:
                found.append(str(exc))
        elif sections_field is not None and isinstance(value, Mapping | None):
            sections[key] = dict(value or {})
        else:
            known = [n for n, f in fields.items()
                     if n != sections_field and not f.metadata.get(DERIVED)]
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            found.append(
                f"{sub}: unknown key.{hint} Valid keys under {where}: {', '.join(sorted(known))}."
            )
    if sections_field is not None:
        kwargs[sections_field] = sections
    missing = [n for n, f in fields.items() if f.default is attrs.NOTHING and n not in data]
    if missing:
        found.append(f"{where}: missing required key(s) {', '.join(missing)}.")
    invalid = _field_validator_problems(cls, kwargs, where)
    found += [message for _, message in invalid]
    if found and problems is None:
        raise ConfigError("\n".join(found))
    if found:
        problems += found
        for name, _ in invalid:
            kwargs.pop(name)
    try:
        return cls(**kwargs)
    except (ConfigError, TypeError, ValueError) as exc:
        if problems is None:
            raise ConfigError(f"{where}: {exc}") from None
        problems.append(f"{where}: {exc}")
        return cls()


def _field_validator_problems(cls: type, kwargs: dict[str, Any],
                              where: str) -> list[tuple[str, str]]:
    """`(field, message)` of each field validator failure (attrs stops at the first).

    Validators that read other fields of the instance run when the class is built.
    """
    problems = []
    for field in attrs.fields(cls):
        if field.validator is None or field.name not in kwargs:
            continue
        try:
            field.validator(None, field, kwargs[field.name])
        except (ConfigError, TypeError, ValueError) as exc:
            problems.append((field.name, f"{where}: {exc}"))
        except AttributeError:
            continue
    return problems


def unstructure(obj: Any) -> Any:
    """Converts a config instance back to plain YAML-ready data (sections inlined)."""
    if attrs.has(type(obj)):
        out: dict[str, Any] = {}
        for f in attrs.fields(type(obj)):
            if f.metadata.get(DERIVED):
                continue
            value = unstructure(getattr(obj, f.name))
            if f.metadata.get(SECTIONS):
                out.update(value)
            else:
                out[f.name] = value
        return out
    if isinstance(obj, Mapping):
        return {k: unstructure(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [unstructure(v) for v in obj]
    return obj


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Applies one `a.b.c=value` override to plain config data in place.

    The value is parsed as YAML (`3`, `1e-3`, `true`, `[1, 2]`, `{k: v}`); the config
    classes then convert it to the field's type.

    Raises:
        ConfigError: the assignment has no `=` or walks through a non-mapping value.
    """
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set trainer.lr=1e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {assignment!r}: value is not valid YAML ({exc})") from None
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                f"--set {assignment!r}: {'.'.join(parts[: i + 1])} is {child!r}, not a mapping."
            )
        node = child
    node[parts[-1]] = value
