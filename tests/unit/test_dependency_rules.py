"""The one-way dependency rules of DESIGN.md, checked on the source tree."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("vllm", "sglang", "deepspeed", "megatron", "ray")

# Folders of the `peerflow` package; "core" is every module outside the satellites.
SATELLITES = ("plugins", "adapters", "contrib", "conformance")
FORBIDDEN = {
    "core": ("peerflow.adapters", "peerflow.contrib", "peerflow.conformance"),
    "plugins": ("peerflow.adapters",),
    "adapters": ("peerflow.conformance", "peerflow.contrib"),
}


def _imports(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _sources(folder: str) -> list[Path]:
    package = ROOT / "peerflow"
    if folder != "core":
        return sorted((package / folder).rglob("*.py"))
    return sorted(path for path in package.rglob("*.py")
                  if path.relative_to(package).parts[0] not in SATELLITES)


def _assert_no_imports(folder: str, forbidden: tuple[str, ...]) -> None:
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in _sources(folder) for line, module in _imports(path)
           if module.startswith(forbidden)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_dependencies_point_one_way(folder):
    _assert_no_imports(folder, FORBIDDEN[folder])


@pytest.mark.parametrize("folder", ["core", "plugins", "adapters"])
def test_engines_are_imported_lazily(folder):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module} at module level"
           for path in _sources(folder) for line, module in _imports(path, top_level_only=True)
           if module.split(".")[0] in ENGINES]
    assert not bad, "\n".join(bad)


def test_adapters_do_not_import_each_other():
    """Shared code lives in the core (e.g. `peerflow.training`), not in another adapter."""
    adapters = ROOT / "peerflow" / "adapters"
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


# Layers of the core: a package never imports one that runs it. The config knows only
# its own schema (subsystems check it through `peerflow_validate_config`); planning
# (workflow, planner) knows nothing of the processes that execute a plan; the streaming
# pieces know nothing of the worker that wires them; the data and weight movers know
# nothing of plans or workers.
RUNNERS = ("peerflow.worker", "peerflow.launch", "peerflow.cli", "peerflow.api")
CORE_LAYERS = {
    "config": (*RUNNERS, "peerflow.streaming", "peerflow.planner", "peerflow.workflow",
               "peerflow.algorithms", "peerflow.rewards"),
    "workflow": (*RUNNERS, "peerflow.streaming", "peerflow.planner"),
    "planner": (*RUNNERS, "peerflow.streaming"),
    "checkpoint": (*RUNNERS, "peerflow.streaming", "peerflow.planner"),
    "streaming": (*RUNNERS, "peerflow.planner"),
    "coordinator": (*RUNNERS, "peerflow.streaming", "peerflow.planner", "peerflow.workflow"),
    "reshard": (*RUNNERS, "peerflow.streaming", "peerflow.planner", "peerflow.workflow"),
    "engines": (*RUNNERS, "peerflow.streaming", "peerflow.planner", "peerflow.workflow"),
}


@pytest.mark.parametrize("layer", sorted(CORE_LAYERS))
def test_core_layers_point_down(layer):
    _assert_no_imports(layer, CORE_LAYERS[layer])
