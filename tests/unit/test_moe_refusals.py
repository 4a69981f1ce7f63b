"""MoE settings at `config validate`: routing replay needs the engines' capabilities."""

from __future__ import annotations

from peerflow.config import load_config
from peerflow.config.refusals import capability_problems


def _problems(plugin_manager, *overrides: str) -> str:
    return "\n".join(capability_problems(load_config(None, list(overrides)), plugin_manager))


def test_r3_needs_a_rollout_engine_that_returns_routes(plugin_manager):
    text = _problems(plugin_manager, "rollout.backend=vllm", "trainer.backend=fsdp",
                     "trainer.routing_replay=r3")
    assert ("trainer.routing_replay=r3: rollout.backend='vllm' does not declare "
            "Capabilities.routed_experts: vLLM returns routed experts only under Model Runner "
            "V2") in text
    assert "Fix: set trainer.routing_replay: r2 (the trainer's own routes) or off, or use " \
           "rollout.backend hf" in text
    assert len(text.splitlines()) == 1


def test_replay_needs_a_trainer_under_the_controller(plugin_manager):
    text = _problems(plugin_manager, "rollout.backend=hf", "trainer.backend=megatron",
                     "trainer.routing_replay=r2")
    assert "trainer.routing_replay=r2: trainer.backend='megatron' does not declare " \
           "Capabilities.routing_replay: the megatron adapter builds dense GPTModels" in text
    assert "use trainer.backend deepspeed or fsdp" in text


def test_hf_rollout_and_fsdp_replay_pass(plugin_manager):
    for mode in ("off", "r2", "r3"):
        assert _problems(plugin_manager, "rollout.backend=hf", "trainer.backend=fsdp",
                         f"trainer.routing_replay={mode}") == ""
