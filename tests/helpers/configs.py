"""Config helpers shared by the config tests."""

from __future__ import annotations

import pytest

from peerflow.config import load_config, validate_config
from peerflow.errors import ConfigError


def validation_error(plugin_manager, *overrides: str) -> str:
    """The message of the `ConfigError` validating the default config with `overrides` raises."""
    config = load_config(None, list(overrides))
    with pytest.raises(ConfigError) as info:
        validate_config(config, plugin_manager)
    return str(info.value)
