"""RL algorithm building blocks: rewards, advantage estimators, policy losses, tasks."""

from peerflow.algorithms.base import AdvantageEstimator, Example, PolicyLoss, RewardFunction, Task

__all__ = ["AdvantageEstimator", "Example", "PolicyLoss", "RewardFunction", "Task"]
