"""Registers the `vllm` rollout engine through PeerFlow's entry-point group.

The engine package itself is imported only when the engine is built.
"""

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_rollout_engines(register):
    """Registers `VLLMRolloutEngine`."""
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine

    register(VLLMRolloutEngine)


@hookimpl
def peerflow_validate_config(config, pm):
    """Refuses, before any process starts, a model family vLLM cannot take weights for."""
    if config.rollout.backend != "vllm":
        return []
    from peerflow.models.vllm import vllm_family_problem

    problem = vllm_family_problem(_model_type(config.model))
    return [f"rollout.backend=vllm: {problem}"] if problem else []


def _model_type(model):
    """The policy's `model_type`: its directory's config.json, or the builder's option."""
    from peerflow.models.vllm import model_type_at

    return model_type_at(model.path) if model.path else model.builder_options.get("model_type")
