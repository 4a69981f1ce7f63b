"""The package layers of docs/architecture.md ("Package layers"), checked on the source tree.

Every package and top-level module of `peerflow/` has a tier; an import (at any depth in a
module, `TYPE_CHECKING` included) goes to the importer's own tier or a lower one; nothing
in PeerFlow imports the satellites (adapters, contrib, conformance, bench, testing), which
are reached through entry points, pytest, torch's device hook or the CLI by name; and the
package import graph has no cycle. A module named in a string (for `importlib` later) is
held to the same tiers, except in the files of `BY_NAME`, and must exist.
"""

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "peerflow"
ENGINES = ("vllm", "sglang", "deepspeed", "megatron", "ray")

#: Each package's tier, lowest first (docs/architecture.md, "Package layers").
TIERS = {
    # 0. Values and vocabulary: no PeerFlow imports beyond each other.
    "errors": 0, "rounding": 0, "ragged": 0, "capabilities": 0, "shard": 0, "layout": 0,
    "batch": 0, "routes": 0, "digests": 0, "wirecodec": 0,
    # 1. Services that know no run: plugins, process groups, model families, the
    #    workflow graph, the data coordinator.
    "plugins": 1, "distributed": 1, "models": 1, "workflow": 1, "coordinator": 1,
    # 2. Contracts and settings: the engine contracts, the config schema, the sandbox.
    "engines": 2, "config": 2, "sandbox": 2,
    # 3. Components a run is made of.
    "algorithms": 3, "rewards": 3, "reshard": 3, "training": 3, "checkpoint": 3,
    "outputs": 3, "planner": 3, "rollout": 3,
    # 4. The drivers' parts: streaming schedules and multi-turn episodes.
    "streaming": 4, "agents": 4,
    # 5. The worker: one process's run.
    "worker": 5,
    # 6. What starts workers or reads their results.
    "launch": 6, "hf_export": 6,
    # 7. Fronts: the Python API, the CLI, `python -m peerflow`.
    "api": 7, "cli": 8, "__main__": 9,
    # Satellites (nothing in PeerFlow imports them); their own imports still point down.
    "testing": 0, "adapters": 4, "conformance": 4, "contrib": 5, "bench": 7,
}
SATELLITES = ("adapters", "bench", "conformance", "contrib", "testing")
#: The files that may name a higher tier's (or a satellite's) module in a string, and why.
BY_NAME = {
    "peerflow/plugins/manager.py": "loads the core's own registrations (CORE_PLUGINS) the way "
    "it loads entry points",
    "peerflow/plugins/registry.py": "checks each registered class against its contract "
    "(Kind.base), imported when the first one registers",
    "peerflow/cli/conformance_cmd.py": "runs the conformance suite under pytest",
}
_DOTTED = re.compile(r"^peerflow(\.[A-Za-z_]\w*)+(:[\w.]+)?$")


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The parsed source (each file is parsed once for all the checks)."""
    return ast.parse(path.read_text(), filename=str(path))


def _imports(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    tree = _tree(path)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _package_of(module: str) -> str | None:
    """The top-level package or module of `peerflow/` that `module` names, if any."""
    parts = module.split(".")
    if parts[0] != "peerflow" or len(parts) < 2:
        return None
    name = parts[1]
    return name if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file() else None


def _packages() -> list[str]:
    """Every package and top-level module of `peerflow/` (its `__init__.py` is the facade)."""
    names = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    return sorted(names)


def _sources(package: str) -> list[Path]:
    folder = PACKAGE / package
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{package}.py"]


@functools.cache
def _edges() -> dict[str, dict[str, list[str]]]:
    """importer package -> imported package -> the `file:line`s that import it."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for package in _packages():
        for path in _sources(package):
            for line, module in _imports(path):
                target = _package_of(module)
                where = f"{path.relative_to(ROOT)}:{line}"
                if target is not None and target != package and where not in edges[package][target]:
                    edges[package][target].append(where)
    return edges


def test_every_package_has_a_tier():
    missing = [name for name in _packages() if name not in TIERS]
    gone = [name for name in TIERS if name not in _packages()]
    assert not missing, (f"packages without a tier: {missing}; add each to TIERS here and to "
                         "docs/architecture.md's 'Package layers'")
    assert not gone, f"TIERS names packages that no longer exist: {gone}"


def test_imports_point_down_or_sideways():
    edges = _edges()
    bad = [f"{where} imports peerflow.{target} (tier {TIERS[target]}) from {package} "
           f"(tier {TIERS[package]})"
           for package, targets in sorted(edges.items()) if package in TIERS
           for target, places in sorted(targets.items()) if target in TIERS
           and TIERS[target] > TIERS[package] for where in places]
    assert not bad, "imports that run back up:\n" + "\n".join(bad)


def test_nothing_imports_a_satellite():
    edges = _edges()
    bad = [f"{where} imports peerflow.{target}"
           for package, targets in sorted(edges.items())
           for target, places in sorted(targets.items()) if target in SATELLITES
           for where in places]
    assert not bad, "\n".join(bad)


def _named_in_strings(path: Path) -> list[tuple[int, str]]:
    """`peerflow.…` module paths in string constants (not docstrings or logger names)."""
    tree = _tree(path)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))  # docstrings and bare strings
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "getLogger":
            skip.update(id(arg) for arg in node.args)
    return [(node.lineno, node.value.partition(":")[0]) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip and _DOTTED.match(node.value)]


def _exists(dotted: str) -> bool:
    """Whether `dotted` is a module of `peerflow/` or a name in one (`module.Class`)."""
    parts = dotted.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        base = PACKAGE.joinpath(*parts[:cut])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return cut >= len(parts) - 2  # at most `module.Class.attribute` beyond it
    return False


def test_modules_named_in_strings_follow_the_tiers_and_exist():
    bad = []
    for package in _packages():
        for path in _sources(package):
            where = str(path.relative_to(ROOT))
            for line, dotted in _named_in_strings(path):
                target = _package_of(dotted)
                if target is None:
                    continue  # a file name such as `peerflow.log`
                if not _exists(dotted):
                    bad.append(f"{where}:{line} names {dotted!r}, which does not exist")
                elif (target != package and where not in BY_NAME
                      and (target in SATELLITES or TIERS[target] > TIERS[package])):
                    bad.append(f"{where}:{line} names peerflow.{target} (tier {TIERS[target]}) "
                               f"from {package} (tier {TIERS[package]})")
    assert not bad, "\n".join(bad)


def _cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(edges) | {t for targets in edges.values() for t in targets}):
        if node not in index:
            visit(node)
    return found


def test_the_package_import_graph_has_no_cycle():
    edges = _edges()
    described = []
    for cycle in _cycles(edges):
        ties = [f"  {a} -> {b}: {', '.join(edges[a][b][:3])}"
                for a in cycle for b in cycle if b in edges.get(a, {})]
        described.append(" <-> ".join(cycle) + "\n" + "\n".join(ties))
    assert not described, "import cycles between packages:\n" + "\n".join(described)


@pytest.mark.parametrize("package", [p for p in TIERS if p not in ("adapters", "bench")])
def test_engines_are_imported_lazily(package):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module} at module level"
           for path in _sources(package) for line, module in _imports(path, top_level_only=True)
           if module.split(".")[0] in ENGINES]
    assert not bad, "\n".join(bad)


def test_adapters_do_not_import_each_other():
    """Shared code lives in the core (e.g. `peerflow.training`), not in another adapter."""
    adapters = PACKAGE / "adapters"
    bad = []
    for path in sorted(adapters.rglob("*.py")):
        parts = path.relative_to(adapters).parts
        if len(parts) < 2:
            continue
        own = f"peerflow.adapters.{parts[0]}"
        bad += [f"{path.relative_to(ROOT)}:{line} imports {module}"
                for line, module in _imports(path)
                if module.startswith("peerflow.adapters.")
                and module != own and not module.startswith(own + ".")]
    assert not bad, "\n".join(bad)
