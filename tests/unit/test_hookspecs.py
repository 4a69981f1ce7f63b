"""Every hook a plugin implements is written out in `peerflow/plugins/hookspecs.py`.

Written out means a plain module-level `def` that grep, go-to-definition and pyright find,
with a real docstring (what to register, the base class, an example), not a function
generated at import time.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import shutil
import subprocess
import sys
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


def test_pyright_resolves_every_hookspec_a_plugin_names(tmp_path):
    """Go-to-definition from a plugin: pyright finds every hook in `hookspecs`."""
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if pyright is None:
        pytest.skip("pyright is not installed (it is in the `test` extra)")
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(
        "from peerflow.plugins import hookimpl\n"
        f"from peerflow.plugins.hookspecs import {', '.join(WRITTEN_OUT)}, not_a_hook\n\n\n"
        "@hookimpl\n"
        "def peerflow_register_rollout_engines(register):\n"
        "    del register\n")
    site = tmp_path / ".venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (site / "site-packages").mkdir(parents=True)  # no packages: peerflow from the checkout
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({
        "include": [plugin.name], "extraPaths": [str(Path(hookspecs.__file__).parents[2])],
        "venvPath": str(tmp_path), "venv": ".venv", "typeCheckingMode": "off",
        "reportAttributeAccessIssue": "error", "reportMissingImports": "error"}))
    result = subprocess.run([pyright, "--outputjson", "-p", str(tmp_path / "pyrightconfig.json")],
                            capture_output=True, text=True, timeout=300)
    unknown = [d["message"] for d in json.loads(result.stdout)["generalDiagnostics"]]
    assert unknown == ['"not_a_hook" is unknown import symbol'], unknown
