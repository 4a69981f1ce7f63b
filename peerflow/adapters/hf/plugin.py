"""Registers the `hf` rollout engine through PeerFlow's entry-point group.

The engine package itself is imported only when the engine is built.
"""

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_rollout_engines(register):
    """Registers `HFRolloutEngine`."""
    from peerflow.adapters.hf.engine import HFRolloutEngine

    register(HFRolloutEngine)
