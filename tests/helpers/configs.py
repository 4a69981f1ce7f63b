"""Config helpers shared by the config tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from peerflow.config import load_config, validate_config
from peerflow.config.extras import dependency_problems
from peerflow.errors import ConfigError

#: The quickstart config every CLI test starts from.
QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")


#: Async mode with staleness 1 on two ranks, split: one rollout rank, one trainer rank.
ASYNC_SPLIT_PAIR = ["runtime.mode=async", "runtime.max_staleness=1", "runtime.placement=split",
                    "rollout.layout.dp=1", "trainer.layout.dp=1"]


def started_run_dir(path: Path) -> Path:
    """`path` as a started run leaves its run directory: config.yaml and fingerprint.json."""
    from peerflow.outputs import write_resolved_config

    write_resolved_config(path, load_config(QUICKSTART))
    return path


def validation_error(plugin_manager, *overrides: str) -> str:
    """The message of the `ConfigError` validating the default config with `overrides` raises."""
    config = load_config(None, list(overrides))
    with pytest.raises(ConfigError) as info:
        validate_config(config, plugin_manager)
    return str(info.value)


def hide_modules(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Makes the top-level modules `names` (and their submodules) look not installed.

    `importlib.util.find_spec` answers None for them until the test ends; nothing is
    uninstalled, and modules already imported stay importable.
    """
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):
        return None if name.split(".")[0] in names else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def dependency_text(plugin_manager, *overrides: str) -> str:
    """The optional-library problems of the default config with `overrides`, one a line."""
    return "\n".join(dependency_problems(load_config(None, list(overrides)), plugin_manager))
