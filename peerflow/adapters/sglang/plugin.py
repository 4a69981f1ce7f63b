"""Registers the `sglang` rollout engine through PeerFlow's entry-point group.

The engine package itself is imported only when the engine is built.
"""

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_rollout_engines(register):
    """Registers `SGLangRolloutEngine`."""
    from peerflow.adapters.sglang.engine import SGLangRolloutEngine

    register(SGLangRolloutEngine)
