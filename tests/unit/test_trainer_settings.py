"""Every trainer setting is written once (`OptimSettings`), with one default and one name."""

from __future__ import annotations

import attrs
import pytest

from peerflow.config import TrainerConfig, dump_config, load_config
from peerflow.engines import OptimSettings
from peerflow.engines.settings import DERIVED
from peerflow.errors import ConfigError
from tests.helpers.configs import validation_error

SETTINGS = [f.name for f in attrs.fields(OptimSettings) if not f.metadata.get(DERIVED)]


def test_the_config_section_is_the_engine_settings_class():
    assert issubclass(TrainerConfig, OptimSettings)
    own = {f.name for f in attrs.fields(TrainerConfig)} - {f.name for f in
                                                             attrs.fields(OptimSettings)}
    assert own == {"backend", "layout", "lora", "engine_options"}
    for name in SETTINGS:  # one default: an engine built directly gets what a run gets
        assert getattr(TrainerConfig(), name) == getattr(OptimSettings(), name), name


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed", "megatron"])
def test_adapters_keep_no_copy_of_a_trainer_setting(plugin_manager, backend):
    options = plugin_manager.get("train_engine", backend).options_class
    names = {f.name for f in attrs.fields(options)}
    assert not names & set(SETTINGS), f"trainer.{backend} repeats {names & set(SETTINGS)}"
    assert "gradient_checkpointing" not in names


def test_the_engine_gets_the_run_length_and_resolved_warm_up():
    config = load_config(None, ["trainer.warmup_ratio=0.1", "trainer.mini_batches=2",
                                "trainer.lr=1e-4", "run.steps=50"])
    optim = config.trainer.optim_settings(steps=config.run.steps)
    assert type(optim) is OptimSettings
    assert (optim.total_steps, optim.warmup_steps, optim.warmup_ratio) == (100, 10, 0.0)
    assert optim.lr == 1e-4 and optim.mini_batches == 2
    assert "total_steps" not in dump_config(config)


def test_derived_and_renamed_keys_are_clear_errors(plugin_manager):
    with pytest.raises(ConfigError, match=r"trainer.total_steps: not a setting.*run.steps"):
        load_config(None, ["trainer.total_steps=10"])
    for backend in ("fsdp", "deepspeed"):
        message = validation_error(plugin_manager, f"trainer.backend={backend}",
                                   f"trainer.{backend}.gradient_checkpointing=true")
        assert f"trainer.{backend}.gradient_checkpointing: renamed; set " \
               "trainer.activation_checkpointing: true instead" in message
