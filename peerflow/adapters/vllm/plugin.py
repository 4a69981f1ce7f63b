"""Registers the `vllm` rollout engine through PeerFlow's entry-point group.

The engine package itself is imported only when the engine is built; `config validate`
refuses the model families vLLM cannot take weights for
(`VLLMRolloutEngine.config_problems`).
"""

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_rollout_engines(register):
    """Registers `VLLMRolloutEngine`."""
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine

    register(VLLMRolloutEngine)
