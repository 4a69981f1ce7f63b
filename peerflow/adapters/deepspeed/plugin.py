"""Registers the `deepspeed` train engine through PeerFlow's entry-point group.

The engine package itself is imported only when the engine is built.
"""

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_train_engines(register):
    """Registers `DeepSpeedTrainEngine`."""
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine

    register(DeepSpeedTrainEngine)
