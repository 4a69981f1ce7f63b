"""One way to say "I can't": capabilities and optional libraries refused at `config validate`.

The refusals are checked against stub engines (no plugin needed), then through
`validate_config` with the real plugin manager; absent libraries are simulated by
monkeypatching `importlib.util.find_spec` in-process, and, for the CLI, by a
`sitecustomize` that hides them from a subprocess (nothing is uninstalled). The ecosystem
integrations' libraries (`ECOSYSTEM`) are checked here too, so their refusals are tested
where the libraries are not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerflow.capabilities import Capabilities
from peerflow.config import load_config
from peerflow.config.extras import dependency_problems, launcher_problem
from peerflow.config.refusals import DEMANDS, capability_problems
from peerflow.engines.base import EngineBase
from tests.helpers.configs import dependency_text, hide_modules, validation_error

ROOT = Path(__file__).resolve().parents[2]


class _Registry:
    def __init__(self, engines: dict[str, type]) -> None:
        self.engines = engines

    def names(self) -> list[str]:
        return sorted(self.engines)

    def get(self, name: str) -> type:
        return self.engines[name]


class _StubManager:
    """What the refusals read of a plugin manager: `get` and `registry`."""

    def __init__(self, rollout: dict[str, type], train: dict[str, type]) -> None:
        self.registries = {"rollout_engine": _Registry(rollout), "train_engine": _Registry(train)}

    def get(self, kind: str, name: str) -> type:
        return self.registries[kind].get(name)

    def registry(self, kind: str) -> _Registry:
        return self.registries[kind]


def _engine(name: str, **flags: object) -> type:
    return type(name, (), {"name": name, "capabilities": Capabilities(**flags)})


PLAIN = _engine("plain", reasons={"stop_strings": "plain's sampler has no stop strings",
                                  "padding_free": "plain pads"})
ABLE = _engine("able", stop_strings=True, padding_free=True, activation_checkpointing=True,
               lora=True, tensor_parallel=True)
MANAGER = _StubManager({"plain": PLAIN, "able": ABLE}, {"plain": PLAIN, "able": ABLE})


def _problems(*overrides: str, pm: object = MANAGER) -> str:
    return "\n".join(capability_problems(load_config(None, list(overrides)), pm))


def test_reasons_name_real_flags_the_engine_lacks():
    with pytest.raises(ValueError, match="'lorax' is no capability"):
        Capabilities(reasons={"lorax": "typo"})
    with pytest.raises(ValueError, match="lora is declared True"):
        Capabilities(lora=True, reasons={"lora": "contradiction"})
    with pytest.raises(ValueError, match="non-empty sentence"):
        Capabilities(reasons={"lora": " "})
    caps = Capabilities(sleep=True, reasons={"lora": "not wired"})
    assert caps.enabled() == ["sleep"] and "reasons" not in Capabilities.flags()
    assert caps == Capabilities(sleep=True) and hash(caps) == hash(Capabilities(sleep=True))


def test_every_flag_is_read_and_the_unread_ones_are_gone():
    flags = set(Capabilities.flags())
    assert not flags & {"shard_load", "gathers_full_model", "prefix_cache"}
    assert {d.capability for d in DEMANDS} <= flags
    assert not hasattr(EngineBase, "unsupported")  # reasons live in Capabilities


def test_a_setting_the_engine_lacks_is_refused_naming_setting_reason_and_fix():
    text = _problems("rollout.backend=plain", "trainer.backend=able",
                     "rollout.sampling.stop=[END]")
    assert ("rollout.sampling.stop=['END']: rollout.backend='plain' does not declare "
            "Capabilities.stop_strings: plain's sampler has no stop strings") in text
    assert "Fix: remove rollout.sampling.stop" in text and "use rollout.backend able" in text
    text = _problems("rollout.backend=able", "trainer.backend=plain",
                     "trainer.padding_free=true", "trainer.activation_checkpointing=true",
                     "trainer.lora.rank=4", "trainer.layout.tp=2", "runtime.nprocs=2")
    assert "trainer.padding_free=true: trainer.backend='plain' does not declare " \
           "Capabilities.padding_free: plain pads. Fix: set trainer.padding_free: auto" in text
    assert "trainer.activation_checkpointing=true: trainer.backend='plain'" in text
    assert "trainer.lora: trainer.backend='plain' does not declare Capabilities.lora." in text
    assert "trainer.layout.tp=2: trainer.backend='plain'" in text
    assert "Fix: set trainer.layout.tp: 1, or use trainer.backend able." in text
    assert len(text.splitlines()) == 4


def test_what_the_engine_can_do_passes():
    assert _problems("rollout.backend=able", "trainer.backend=able", "rollout.sampling.stop=[x]",
                     "trainer.padding_free=true", "trainer.lora.rank=4") == ""
    assert _problems("rollout.backend=plain", "trainer.backend=plain",
                     "trainer.padding_free=auto") == ""


def test_a_multiprocess_engine_takes_its_tp_as_an_option():
    hosted = _engine("hosted", tensor_parallel=True, multiprocess=True)
    pm = _StubManager({"hosted": hosted}, {"able": ABLE})
    text = _problems("rollout.backend=hosted", "trainer.backend=able", "rollout.layout.tp=2",
                     "runtime.nprocs=2", pm=pm)
    assert "Capabilities.multiprocess" in text and "rollout.hosted" in text


def test_first_party_engines_are_refused_at_validate(plugin_manager):
    message = validation_error(plugin_manager, "trainer.backend=megatron",
                               "trainer.padding_free=true", "trainer.activation_checkpointing=true")
    assert "trainer.padding_free=true: trainer.backend='megatron'" in message
    assert "fixed-shape activations" in message
    assert "does not wire up Megatron's activation recompute" in message
    assert "use trainer.backend deepspeed or fsdp" in message
    message = validation_error(plugin_manager, "trainer.backend=deepspeed", "workflow.graph=ppo")
    assert "trainer.backend='deepspeed' does not declare Capabilities.value_head" in message


def test_absent_libraries_name_the_extra(monkeypatch, plugin_manager):
    hide_modules(monkeypatch, "peft", "deepspeed", "wandb", "ray")
    text = dependency_text(plugin_manager, "trainer.lora.rank=4", "trainer.backend=deepspeed",
                           "run.wandb=true")
    assert "trainer.lora needs the peft package, which is not installed: pip install " \
           "'peerflow[lora]'" in text
    assert "trainer.backend='deepspeed' needs deepspeed" in text
    assert "peerflow[deepspeed]" in text and "peerflow[wandb]" in text
    assert "pip install 'peerflow[ray]'" in launcher_problem("ray")
    assert launcher_problem("elastic") is None
    message = validation_error(plugin_manager, "trainer.lora.rank=4")
    assert "peerflow[lora]" in message


#: The ecosystem integrations: (the library made absent, the settings that need it, what
#: `config validate` must say). None of them needs the library installed.
ECOSYSTEM = {
    "fastapi": (["rollout.agent.environment=agent-program",
                 "rollout.agent.options.function=tests.unit.agent_programs:chat_agent"],
                ["rollout.agent.environment='agent-program' needs the fastapi package, which "
                 "is not installed: pip install 'peerflow[endpoint]'"]),
    "openenv": (["rollout.agent.environment=openenv",
                 "rollout.agent.options.url=http://127.0.0.1:1"],
                ["rollout.agent.environment='openenv' needs the openenv package, which is not "
                 "installed: pip install 'peerflow[openenv]' && pip install --no-deps "
                 "openenv-core==0.3.0"]),
    "reasoning_gym": (["task.name=reasoning-gym", "task.options.dataset=chain_sum"],
                      ["task.name='reasoning-gym' needs the reasoning_gym package, which is "
                       "not installed: pip install 'peerflow[reasoning-gym]'"]),
    "textarena": (["task.name=textarena", "task.options.env_id=GuessTheNumber-v0",
                   "rollout.agent.environment=textarena"],
                  ["task.name='textarena' needs the textarena package",
                   "rollout.agent.environment='textarena' needs the textarena package, which is "
                   "not installed: pip install 'peerflow[textarena]'"]),
    "verifiers": (["task.name=verifiers",
                   "task.options.environment=tests.unit.test_verifiers:load_environment",
                   "rollout.agent.environment=verifiers"],
                  ["task.name='verifiers' needs the verifiers package, which is not installed: "
                   "pip install 'peerflow[verifiers]' && pip install --no-deps verifiers==0.3.1 "
                   "openai-agents==0.24.0",
                   "rollout.agent.environment='verifiers' needs the verifiers package"]),
}


@pytest.mark.parametrize("library", list(ECOSYSTEM))
def test_an_absent_ecosystem_library_names_its_extra_and_install(monkeypatch, plugin_manager,
                                                                  library):
    overrides, expected = ECOSYSTEM[library]
    hide_modules(monkeypatch, library)
    text = dependency_text(plugin_manager, *overrides)
    for message in expected:
        assert message in text


def test_present_libraries_pass(plugin_manager):
    config = load_config(None, [])
    assert dependency_problems(config, plugin_manager) == []


def test_cli_validate_without_peft_deepspeed_wandb_names_the_extras(tmp_path):
    """`peerflow config validate` in a process where the libraries cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nfor name in ('peft', 'deepspeed', 'wandb'):\n    sys.modules[name] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "peerflow", "config", "validate", "examples/quickstart.yaml",
         "--set", "trainer.lora.rank=4", "--set", "trainer.backend=deepspeed",
         "--set", "run.wandb=true"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout
    for extra in ("peerflow[lora]", "peerflow[deepspeed]", "peerflow[wandb]"):
        assert extra in result.stderr, result.stderr
