"""Rewards of one's own: functions from a file or module, run with limits, built-ins.

* `loading` — `rewards.py:score` / `pkg.mod:score` references, signatures, early errors;
* `pool` — worker processes with a per-call time limit and a memory limit;
* `scoring` — `RewardSet`: weighted rewards scoring a batch, failures counted and logged;
* `setup` — building it from `task.reward` / `task.rewards`, and the config validator;
* `code` — running candidate programs against tests in the sandbox; `assert_harness`
  and `assert_checks` judge assert-style tests on the host (`forgeries`: what must score
  0), `deadline` lets a program's time limit end before its reward call's;
* `math` — final-answer equivalence (boxed answers, fractions, expressions).

Importing this package does not import torch: reward worker processes stay light.
"""

from peerflow.rewards.loading import RewardLoadError, callable_target
from peerflow.rewards.pool import Outcome, RewardPool
from peerflow.rewards.scoring import RewardComponent, RewardScores, RewardSet
from peerflow.rewards.setup import build_reward_set, check_rewards

__all__ = [
    "Outcome",
    "RewardComponent",
    "RewardLoadError",
    "RewardPool",
    "RewardScores",
    "RewardSet",
    "build_reward_set",
    "callable_target",
    "check_rewards",
]
