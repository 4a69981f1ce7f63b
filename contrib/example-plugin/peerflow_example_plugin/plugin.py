"""Entry point `example` in group `peerflow`: registers the reward and the estimator."""

from peerflow.plugins import hookimpl


@hookimpl
def peerflow_register_rewards(register):
    """Registers `edit-similarity`."""
    from peerflow_example_plugin.rewards import EditSimilarityReward

    register(EditSimilarityReward)


@hookimpl
def peerflow_register_advantage_estimators(register):
    """Registers `opo`."""
    from peerflow_example_plugin.opo import OPOAdvantage

    register(OPOAdvantage)
