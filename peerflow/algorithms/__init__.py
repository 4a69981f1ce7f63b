"""RL algorithm building blocks: rewards, advantage estimators, policy losses, tasks.

Concrete estimators (`grpo`, `rloo`, `reinforce_pp`, `gae`) and losses (`ppo_clip`,
`gspo`) register through `peerflow.algorithms.plugin`; look them up by name through the
plugin registry, or build a run's set with `build_algorithm`. KL helpers live in
`peerflow.algorithms.kl`, the KL and entropy terms of the loss in
`peerflow.algorithms.regularized`, decoupled PPO's importance weights and the
rollout-vs-trainer mismatch in `peerflow.algorithms.off_policy`, DAPO's dynamic sampling
and overlong shaping in `peerflow.algorithms.dynamic_sampling` and
`peerflow.algorithms.overlong`, the critic's loss in `peerflow.algorithms.value_loss`.
See docs/algorithms.md for the formulas and what each was checked against.
"""

from peerflow.algorithms.base import AdvantageEstimator, Example, PolicyLoss, RewardFunction, Task
from peerflow.algorithms.dynamic_sampling import filter_groups, take_groups
from peerflow.algorithms.kl import apply_kl_penalty, kl_estimate
from peerflow.algorithms.regularized import RegularizedLoss
from peerflow.algorithms.setup import Algorithm, build_algorithm, check_model_builder

__all__ = [
    "AdvantageEstimator",
    "Algorithm",
    "Example",
    "PolicyLoss",
    "RegularizedLoss",
    "RewardFunction",
    "Task",
    "apply_kl_penalty",
    "build_algorithm",
    "check_model_builder",
    "filter_groups",
    "kl_estimate",
    "take_groups",
]
