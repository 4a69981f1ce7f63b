"""Config helpers shared by the config tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerflow.config import load_config, validate_config
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
