"""RL algorithm building blocks: rewards, advantage estimators, policy losses, tasks.

Concrete estimators (`grpo`, `rloo`, `reinforce_pp`, `gae`) and losses (`ppo_clip`,
`gspo`) register through `peerflow.algorithms.plugin`; look them up by name through the
plugin registry or build a run's set with `build_algorithm`. KL helpers live in
`peerflow.algorithms.kl`, DAPO's dynamic sampling in `peerflow.algorithms.dynamic_sampling`.
"""

from peerflow.algorithms.base import AdvantageEstimator, Example, PolicyLoss, RewardFunction, Task

__all__ = ["AdvantageEstimator", "Example", "PolicyLoss", "RewardFunction", "Task"]
