"""RL algorithm building blocks: rewards, advantage estimators, policy losses, tasks.

Concrete estimators (`grpo`, `rloo`, `reinforce_pp`, `gae`) and losses (`ppo_clip`,
`gspo`) register through `peerflow.algorithms.plugin`; look them up by name through the
plugin registry, or build a run's set with `build_algorithm`. KL helpers live in
`peerflow.algorithms.kl`, DAPO's dynamic sampling in `peerflow.algorithms.dynamic_sampling`,
the critic's loss in `peerflow.algorithms.value_loss`.
"""

from peerflow.algorithms.base import AdvantageEstimator, Example, PolicyLoss, RewardFunction, Task
from peerflow.algorithms.dynamic_sampling import filter_groups, take_groups
from peerflow.algorithms.kl import KLRegularizedLoss, apply_kl_penalty, kl_estimate
from peerflow.algorithms.setup import Algorithm, build_algorithm, check_model_builder

__all__ = [
    "AdvantageEstimator",
    "Algorithm",
    "Example",
    "KLRegularizedLoss",
    "PolicyLoss",
    "RewardFunction",
    "Task",
    "apply_kl_penalty",
    "build_algorithm",
    "check_model_builder",
    "filter_groups",
    "kl_estimate",
    "take_groups",
]
