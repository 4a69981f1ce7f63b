"""`rollout.agent`: structured, validated before workers start, with clear errors."""

from __future__ import annotations

import pytest

from peerflow.config import load_config, validate_config
from peerflow.errors import ConfigError
from tests.helpers.configs import validation_error


def test_agent_section_defaults_and_validation(plugin_manager):
    config = load_config(None, ["rollout.agent.environment=retry",
                                "rollout.agent.options.turn_discount=0.8",
                                "rollout.agent.max_turns=3"])
    agent = config.rollout.agent
    assert (agent.environment, agent.max_turns, agent.options) == ("retry", 3,
                                                                   {"turn_discount": 0.8})
    validate_config(config, plugin_manager)
    assert load_config(None, []).rollout.agent is None


def test_unknown_environment_lists_the_registered_ones(plugin_manager):
    message = validation_error(plugin_manager, "rollout.agent.environment=retyr")
    assert "unknown agent environment 'retyr' (rollout.agent.environment)" in message
    assert "Did you mean 'retry'?" in message and "Registered agent environments:" in message


def test_bad_environment_options_and_limits(plugin_manager):
    config = load_config(None, ["rollout.agent.environment=retry",
                                "rollout.agent.options.feedbak=x"])
    with pytest.raises(ConfigError, match=r"rollout.agent.options.feedbak: unknown key. "
                                          r"Did you mean 'feedback'\?"):
        validate_config(config, plugin_manager)
    with pytest.raises(ConfigError, match=r"rollout.agent.*'max_turns' must be > 0: 0"):
        load_config(None, ["rollout.agent.environment=retry", "rollout.agent.max_turns=0"])
    with pytest.raises(ConfigError, match="rollout.agent: missing required key"):
        load_config(None, ["rollout.agent.max_turns=2"])
