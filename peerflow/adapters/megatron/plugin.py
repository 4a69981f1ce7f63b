"""Registers the `megatron` train engine through PeerFlow's entry-point group.

The engine package itself is imported only when the engine is built; `config validate`
refuses the model families and MoE layouts it cannot build
(`MegatronTrainEngine.config_problems`).
"""

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_train_engines(register):
    """Registers `MegatronTrainEngine`."""
    from peerflow.adapters.megatron.engine import MegatronTrainEngine

    register(MegatronTrainEngine)
