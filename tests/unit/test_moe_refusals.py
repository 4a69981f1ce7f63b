"""MoE settings at `config validate`: routing replay needs the engines' capabilities."""

from __future__ import annotations

from peerflow.config import load_config
from peerflow.config.refusals import capability_problems


def _problems(plugin_manager, *overrides: str) -> str:
    return "\n".join(capability_problems(load_config(None, list(overrides)), plugin_manager))


def test_r3_needs_a_rollout_engine_that_returns_routes(plugin_manager):
    text = _problems(plugin_manager, "rollout.backend=sglang", "trainer.backend=fsdp",
                     "trainer.routing_replay=r3")
    assert ("trainer.routing_replay=r3: rollout.backend='sglang' does not declare "
            "Capabilities.routed_experts: SGLang's return_routed_experts is not wired") in text
    assert "Fix: set trainer.routing_replay: r2 (the trainer's own routes) or off, or use " \
           "rollout.backend hf or vllm" in text
    assert len(text.splitlines()) == 1


def test_r3_with_vllm_is_the_run_machine_s_question_not_the_validating_one_s(plugin_manager):
    """vLLM declares routed experts; whether a machine gives them is asked where it runs."""
    assert _problems(plugin_manager, "rollout.backend=vllm", "trainer.backend=fsdp",
                     "trainer.routing_replay=r3") == ""


def test_expert_parallelism_needs_a_trainer_that_splits_experts(plugin_manager):
    text = _problems(plugin_manager, "rollout.backend=hf", "trainer.backend=fsdp",
                     "trainer.layout.ep=2")
    assert "trainer.layout.ep=2: trainer.backend='fsdp' does not declare " \
           "Capabilities.expert_parallel" in text
    assert "Fix: set trainer.layout.ep: 1, or use trainer.backend megatron" in text


def test_megatron_replays_and_splits_experts(plugin_manager):
    for mode in ("off", "r2", "r3"):
        assert _problems(plugin_manager, "rollout.backend=hf", "trainer.backend=megatron",
                         f"trainer.routing_replay={mode}", "trainer.layout.ep=2") == ""


def test_hf_rollout_and_fsdp_replay_pass(plugin_manager):
    for mode in ("off", "r2", "r3"):
        assert _problems(plugin_manager, "rollout.backend=hf", "trainer.backend=fsdp",
                         f"trainer.routing_replay={mode}") == ""


def test_gpt_oss_on_vllm_is_refused_at_validate_naming_the_reason(plugin_manager):
    from peerflow.config import validate_config
    from peerflow.errors import ConfigError

    for model_type, refused in (("gpt_oss", True), ("mixtral", False), ("qwen3_moe", False)):
        config = load_config(None, ["rollout.backend=vllm", "model.builder=reverse-digits",
                                    f"model.builder_options.model_type={model_type}"])
        try:
            validate_config(config, plugin_manager)
            problems = ""
        except ConfigError as exc:
            problems = str(exc)
        assert ("rollout.backend=vllm: model_type 'gpt_oss': vLLM holds GPT-OSS's experts "
                "transposed" in problems) == refused, (model_type, problems)
        if refused:
            assert "use rollout.backend: hf for GPT-OSS" in problems


def test_megatron_refuses_at_validate_what_it_cannot_build(plugin_manager):
    from peerflow.config import validate_config
    from peerflow.errors import ConfigError

    def problems(model_type: str, *overrides: str) -> str:
        config = load_config(None, ["trainer.backend=megatron", "model.builder=reverse-digits",
                                    f"model.builder_options.model_type={model_type}",
                                    *overrides])
        try:
            validate_config(config, plugin_manager)
        except ConfigError as exc:
            return str(exc)
        return ""

    assert problems("qwen3_moe", "trainer.layout.ep=2") == ""
    assert problems("mixtral") == ""
    text = problems("qwen3_moe", "trainer.layout.tp=2")
    assert "trainer.layout tp=2 pp=1: the megatron trainer runs qwen3_moe MoE models with " \
           "tp=1 and pp=1" in text and "Fix: set trainer.layout.tp: 1 and pp: 1" in text
    assert "model_type 'gpt_oss' is not mapped onto Megatron's GPTModel" in problems("gpt_oss")
    assert "trainer.layout.ep=2: the llama model has no experts to split" in \
        problems("llama", "trainer.layout.ep=2")
    split = problems("qwen3_moe", "runtime.mode=async", "runtime.placement=split",
                     "rollout.layout.dp=1", "trainer.layout.dp=1")
    assert "runtime.placement=split: trainer.backend=megatron must span every process" in split
