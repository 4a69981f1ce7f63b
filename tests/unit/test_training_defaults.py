"""Defaults made for real models (issue 33, ranked item 2): learning rate, schedule, bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from peerflow.config import TrainerConfig, load_config
from peerflow.distributed.devices import resolve_bf16
from peerflow.errors import ConfigError
from tests.helpers.configs import validation_error

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_safe_for_a_pretrained_model():
    trainer = TrainerConfig()
    assert trainer.lr == 1e-6  # TRL's and verl's RL default, not the toy's 1e-3
    assert trainer.grad_clip == 1.0 and trainer.bf16 == "auto"
    optim = trainer.optim_settings(steps=100)
    assert (optim.lr, optim.grad_clip, optim.bf16, optim.lr_schedule) == (1e-6, 1.0, "auto",
                                                                         "constant")
    assert optim.total_steps == 100 and optim.warmup_steps == 0


def test_the_schedule_counts_optimiser_steps():
    config = load_config(None, ["trainer.mini_batches=4", "trainer.warmup_ratio=0.1",
                                "trainer.lr_schedule=cosine", "trainer.min_lr_ratio=0.1"])
    optim = config.trainer.optim_settings(steps=config.run.steps)
    assert optim.total_steps == 4 * config.run.steps
    assert optim.warmup_steps == round(0.1 * 4 * config.run.steps)
    assert (optim.lr_schedule, optim.min_lr_ratio) == ("cosine", 0.1)


def test_schedule_mistakes_are_caught_before_workers_start(plugin_manager):
    message = validation_error(plugin_manager, "trainer.lr_schedule=linear", "run.steps=10",
                               "trainer.warmup_steps=10")
    assert "trainer.lr_schedule='linear'" in message and "lr_schedule: constant" in message
    with pytest.raises(ConfigError, match="Did you mean 'cosine'?"):
        load_config(None, ["trainer.lr_schedule=cosin"])
    with pytest.raises(ConfigError, match="set one of them, not both"):
        load_config(None, ["trainer.warmup_steps=5", "trainer.warmup_ratio=0.1"])


def test_bf16_auto_resolves_through_the_device_contract():
    host = torch.device("cpu")
    assert resolve_bf16("auto", host) is False  # float32 on the CPU
    assert resolve_bf16(True, host) is True and resolve_bf16(False, host) is False


def _examples() -> list[Path]:
    return sorted((ROOT / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", _examples(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_sets_its_own_learning_rate(path):
    """Tiny models from scratch learn at 1e-3, pretrained ones at 1e-6: no example relies
    on the default."""
    raw = yaml.safe_load(path.read_text())
    assert "lr" in (raw.get("trainer") or {}), f"{path.name}: set trainer.lr explicitly"


def test_megatron_takes_bf16_auto_only_with_float32_main_parameters():
    from peerflow.adapters.megatron.optim import param_dtype
    from peerflow.adapters.megatron.options import MegatronOptions

    plain, distributed = MegatronOptions(), MegatronOptions(use_distributed_optimizer=True)
    assert param_dtype(True, "auto", plain, "float32") == torch.float32
    assert param_dtype(True, "auto", distributed, "float32") == torch.bfloat16
    assert param_dtype(True, True, plain, "float32") == torch.bfloat16  # forced
    assert param_dtype(False, "auto", distributed, "float32") == torch.float32  # the CPU
