"""Registers the `megatron` train engine through PeerFlow's entry-point group.

The engine package itself is imported only when the engine is built; `config validate`
refuses the model families and MoE layouts it cannot build (`layout.family_problems`).
"""

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_train_engines(register):
    """Registers `MegatronTrainEngine`."""
    from peerflow.adapters.megatron.engine import MegatronTrainEngine

    register(MegatronTrainEngine)


@hookimpl
def peerflow_validate_config(config, pm):
    """Refuses, before any process starts, a model or MoE layout the adapter cannot build."""
    if config.trainer.backend != "megatron":
        return []
    from peerflow.adapters.megatron.layout import family_problems
    from peerflow.models.vllm import model_type_at

    model = config.model
    family = model_type_at(model.path) if model.path else \
        (model.builder_options or {}).get("model_type")
    problems = family_problems(family, config.trainer.layout)
    if config.runtime.placement == "split":
        problems.append(
            "runtime.placement=split: trainer.backend=megatron must span every process "
            "(Megatron's parallel state is global), and a split placement gives the "
            "rollout ranks of their own (so runtime.mode=async cannot run on megatron). Fix: "
            "runtime.placement: colocated with runtime.mode: sync, or trainer.backend fsdp "
            "or deepspeed.")
    return problems
