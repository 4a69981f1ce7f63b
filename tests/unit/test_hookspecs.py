"""Every hook a plugin implements is written out in `peerflow/plugins/hookspecs.py`.

Written out means a plain module-level `def` that grep, go-to-definition and pyright find,
with a real docstring (what to register, the base class, an example), not a function
generated at import time.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from peerflow.plugins import KINDS, hookspecs
from peerflow.plugins.manager import PluginManager

SOURCE = Path(hookspecs.__file__).read_text(encoding="utf-8")
#: The hooks as `grep -c '^def peerflow_' peerflow/plugins/hookspecs.py` counts them.
WRITTEN_OUT = re.findall(r"^def (peerflow_\w+)\(", SOURCE, flags=re.MULTILINE)


def _registered_hooks() -> set[str]:
    """The hooks pluggy knows once the hookspecs module is added."""
    pm = PluginManager()
    return {name for name in vars(pm.hook) if name.startswith("peerflow_")}


def test_grep_counts_every_hook():
    assert len(WRITTEN_OUT) == len(set(WRITTEN_OUT)), "a hookspec is defined twice"
    assert set(WRITTEN_OUT) == _registered_hooks()


def test_hookspecs_are_not_generated():
    assert "globals()" not in SOURCE
    tree = ast.parse(SOURCE)
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
               and any(ast.unparse(d) == "hookspec" for d in node.decorator_list)}
    assert defined == set(WRITTEN_OUT)


@pytest.mark.parametrize("kind", sorted(KINDS.values(), key=lambda k: k.key),
                         ids=lambda kind: kind.key)
def test_every_registry_kind_has_exactly_one_written_out_hookspec(kind):
    assert WRITTEN_OUT.count(kind.hook) == 1, f"{kind.hook} is not written out once"
    spec = getattr(hookspecs, kind.hook)
    assert list(inspect.signature(spec).parameters) == ["register"]
    doc = inspect.getdoc(spec) or ""
    assert kind.config_key in doc, f"{kind.hook} does not say which key selects a class"
    base = kind.base.rpartition(".")[2]
    assert base and base in doc, f"{kind.hook} does not name the base class {kind.base}"
    assert "Example::" in doc and f"def {kind.hook}(register):" in doc


def test_every_registration_hook_is_a_registry_kind():
    hooks = {kind.hook for kind in KINDS.values()}
    registration = {name for name in WRITTEN_OUT if name.startswith("peerflow_register_")}
    assert registration == hooks


@pytest.mark.parametrize("name", WRITTEN_OUT)
def test_every_hook_documents_its_contract(name):
    spec = getattr(hookspecs, name)
    doc = inspect.getdoc(spec) or ""
    assert doc.splitlines()[0].endswith("."), f"{name} lacks a one-line summary"
    for param in inspect.signature(spec).parameters:
        assert f"{param}:" in doc, f"{name} does not document argument {param!r}"
    for section in ("Returns:", "Example::", "Since:"):
        assert section in doc, f"{name} lacks {section!r}"
