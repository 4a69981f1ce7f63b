"""The config reference (`docs/config.md`): every key with its type, default and meaning.

Generated from the config classes themselves: each field's dotted path, its annotation
and default as written, and the docstring under it, which Python does not keep at
runtime, so it is read from the class's source with `ast`. Besides `RunConfig`'s own
sections, the options classes of the built-in engines (`trainer.fsdp`, `rollout.vllm`,
…), tasks (`task.options`), environments, advantage estimators and losses are listed.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from collections.abc import Iterator
from typing import Any

import attrs

from peerflow.engines.settings import DERIVED

#: What a reference lists besides `RunConfig`: plugin kind, where its options live.
OPTION_SECTIONS = (
    ("train_engine", "trainer.{name}"),
    ("rollout_engine", "rollout.{name}"),
    ("task", "task.options (task.name: {name})"),
    ("environment", "rollout.agent.options (rollout.agent.environment: {name})"),
    ("advantage_estimator", "algorithm.options.{name}"),
    ("policy_loss", "algorithm.options.{name}"),
)

HEADER = """# Configuration reference

Generated from the config classes by `peerflow config reference`; do not edit by hand
(`peerflow config reference > docs/config.md` after changing a config class). Set keys
in the YAML file (`trainer: {lr: 1.0e-6}`) or with `--set trainer.lr=1e-6`; relative
paths in a file resolve from the file's directory, in `--set` from the working directory.
"""


def field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """`(annotation as written, docstring)` of each field of `cls` and its attrs bases.

    A field without a docstring has an empty one.
    """
    docs: dict[str, tuple[str, str]] = {}
    for klass in reversed([k for k in cls.__mro__ if attrs.has(k)]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, [*body[1:], None]):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            doc = ""
            if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                doc = inspect.cleandoc(after.value.value)
            docs[node.target.id] = (ast.unparse(node.annotation), doc)
    return docs


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _section_class(tp: Any) -> type | None:
    """The attrs class a field's type holds (`X`, `X | None`), else `None`."""
    if attrs.has(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and attrs.has(args[0]) else None


def _default(field: attrs.Attribute) -> str:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            return "—"
        default = default.factory()
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, tuple):
        default = list(default)
    return f"`{default!r}`" if not isinstance(default, str) else f"`{default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def walk(cls: type, prefix: str) -> Iterator[tuple[str, type, list[tuple[str, str, str, str]]]]:
    """Yields `(path, class, rows)` for `cls` at `prefix` and each nested section.

    Each row is `(dotted key, type, default, meaning)`; a field missing its docstring has
    an empty meaning (the reference test fails on it).
    """
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows, nested = [], []
    for field in attrs.fields(cls):
        if field.metadata.get("peerflow_sections") or field.metadata.get(DERIVED):
            continue
        key = f"{prefix}.{field.name}" if prefix else field.name
        annotation, doc = docs.get(field.name, (_type_name(hints[field.name]), ""))
        section = _section_class(hints[field.name])
        if section is not None:
            nested.append((key, section))
            if not doc:
                continue  # a section's class docstring says what it is
            rows.append((key, annotation, f"section `{key}` below", doc))
            continue
        rows.append((key, annotation, _default(field), doc))
    yield prefix, cls, rows
    for key, section in nested:
        yield from walk(section, key)


def option_classes(pm: Any) -> Iterator[tuple[str, type]]:
    """`(section path, options class)` of every built-in plugin with attrs options."""
    for kind, template in OPTION_SECTIONS:
        registry = pm.registry(kind)
        for name in sorted(registry.names()):
            cls = getattr(registry.get(name), "options_class", None)
            if cls is None or not attrs.has(cls) or not attrs.fields(cls):
                continue
            if not cls.__module__.startswith("peerflow."):
                continue  # third-party plugins document their own options
            yield template.format(name=name), cls


def render(pm: Any) -> str:
    """The whole reference as Markdown."""
    from peerflow.config.schema import RunConfig

    parts = [HEADER]
    sections = list(walk(RunConfig, ""))
    for path, cls in option_classes(pm):
        root = path.split(" ")[0]
        sections += [(path if sub == root else sub, klass, rows)
                     for sub, klass, rows in walk(cls, root)]
    for path, cls, rows in sections:
        if not rows:
            continue
        title = path or "top level"
        summary = _cell(inspect.getdoc(cls) or "").split(". ")[0].rstrip(".")
        parts.append(f"\n## `{title}`\n\n{summary}.\n\n| Key | Type | Default | Meaning |\n"
                     "|---|---|---|---|\n")
        parts.append("".join(f"| `{key}` | `{_cell(tp)}` | {_cell(default)} | {_cell(doc)} |\n"
                             for key, tp, default, doc in rows))
    return "".join(parts)


def undocumented(pm: Any) -> list[str]:
    """Dotted keys (with their class) that have no docstring."""
    from peerflow.config.schema import RunConfig

    walks = [walk(RunConfig, "")] + [walk(cls, path.split(" ")[0])
                                     for path, cls in option_classes(pm)]
    return [f"{key} ({cls.__module__}.{cls.__qualname__})"
            for tree in walks for _, cls, rows in tree for key, _, _, doc in rows if not doc]
