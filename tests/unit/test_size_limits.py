"""The size limits of docs/architecture.md ("Package layers"): small modules, short functions."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted((ROOT / "peerflow").rglob("*.py"))


def test_modules_are_at_most_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split by concept): {long}"


def test_functions_are_at_most_80_lines():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (extract steps): {long}"


def test_no_private_name_is_imported_across_modules():
    """A module split off another owns its names: what a second module needs is public.

    Importing `_name` from another module (the split-off module's private helpers, or a
    re-export of them) hides a dependency the tier test cannot see.
    """
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("peerflow"):
                private = [a.name for a in node.names
                           if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module} "
                                 f"{', '.join(private)}")
    assert not found, f"private names imported across modules (make them public): {found}"
