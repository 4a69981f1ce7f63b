"""What training does with failed samples: the environment's or the reward's failures.

Two kinds of failure, one policy each, both applied here:

* an agent trajectory whose environment raised or ran past its time limit ends with
  `finish_reason` `env_error` or `env_timeout` (the text in `agent_error`); policy
  `rollout.agent.on_env_error` (default `drop_group`). That ending is the
  infrastructure's doing — a crashed sandbox, a tool server that did not answer — not the
  model's: its reward says nothing about the policy, so training on it credits or
  penalises the model for a fault it did not make. Under a group baseline (GRPO, RLOO)
  it also shifts the advantages of the other trajectories of its group;
* a sample whose reward function raised, timed out, died or returned a non-number is
  scored `task.reward_limits.failure_score` and marked `reward_failed` by the reward
  node; policy `task.reward_limits.on_failure` (default `train`: trained at that score,
  as verl's reward managers and TRL do).

The policies:

* `drop_group`: every sample of a group that holds a failed one is left out — the
  group's comparison is corrupted, so none of it is trusted (what DAPO's dynamic
  sampling does with a group that carries no signal);
* `mask`: the failed sample alone is left out; its group's mean and std are computed
  over the others (a group left with one sample gets advantage 0, as any group of one);
* `train`: nothing is left out (the failed sample is trained with whatever reward it
  got; for environments that raise for the model's own failures — an environment should
  end such an episode with `StepResult(done=True)` instead, as `ToolEnvironment` does
  with `end_on_error` for a call that could not run).

A left-out sample stays in the batch — metrics, checkpoints' in-flight accounting and the
async streams see every sample — but its `train_mask` is false (so
`Algorithm.prepare_actor_batch` and the critic's step drop it: it counts in no loss and
no normaliser), its advantage is 0, and `estimate_advantages` runs the estimator over the
kept samples only, so it takes part in no group mean or std and no batch whitening. The
ones the environment policy leaves out are marked `env_excluded`. A step whose samples
are all left out trains nothing: the train engine skips an optimiser step that has no
trained token on any rank (`peerflow.training.engine`).

`apply_failure_policies` and `estimate_advantages` run in one place, the advantage node
(`peerflow.worker.executors.run_advantage`), which the sync and async schedules both run;
dynamic sampling (`run_reward`) reads the same `failure_exclusions`, so a group a policy
drops counts as removed and is refilled. The first environment error of each kind
(finish reason, failing call, exception type) is logged with its text on logger
`peerflow.agents`; every one is counted in `agent/env_errors`, the left-out fraction in
`agent/env_dropped_fraction` (`record_episode_metrics`). Reward failures are logged and
counted (`reward/errors`, `reward/timeouts`) by the `RewardSet`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from peerflow.algorithms.base import dataset_row
from peerflow.batch import Batch, RaggedField

#: `finish_reason`s of trajectories the environment failed (not the model's doing).
ENV_FAULTS = frozenset({"env_error", "env_timeout"})
#: The `[num_samples]` bool field marking samples the environment policy left out.
ENV_EXCLUDED = "env_excluded"
#: The `[num_samples]` bool field marking samples whose reward failed (the reward node's).
REWARD_FAILED = "reward_failed"
#: The values of `rollout.agent.on_env_error` and `task.reward_limits.on_failure`.
POLICIES = ("drop_group", "mask", "train")

log = logging.getLogger("peerflow.agents")
_logged_kinds: set[str] = set()
_logged_lock = threading.Lock()


def env_faults(batch: Batch) -> torch.Tensor:  # [num_samples] bool
    """Which samples the environment failed (`finish_reason` in `ENV_FAULTS`)."""
    reasons = batch["finish_reason"] if "finish_reason" in batch else [""] * len(batch)
    return torch.tensor([r in ENV_FAULTS for r in reasons], dtype=torch.bool)


def reward_failures(batch: Batch) -> torch.Tensor:  # [num_samples] bool
    """Which samples' reward failed (`reward_failed`; none without the field)."""
    if REWARD_FAILED not in batch:
        return torch.zeros(len(batch), dtype=torch.bool)
    return batch[REWARD_FAILED].to(torch.bool)


def excluded_samples(batch: Batch, faults: torch.Tensor, policy: str,
                     setting: str = "rollout.agent.on_env_error") -> torch.Tensor:
    """Which samples `policy` leaves out of training, given the failed ones (`faults`).

    Raises:
        ValueError: `policy` is not one of `POLICIES` (the message names `setting`).
    """
    if policy not in POLICIES:
        raise ValueError(f"{setting}={policy!r} is not a policy; use one of "
                         f"{', '.join(POLICIES)}.")
    if policy == "train" or not bool(faults.any()):
        return torch.zeros(len(batch), dtype=torch.bool)
    if policy == "mask":
        return faults
    return torch.isin(batch.group_id, batch.group_id[faults])


def error_kind(reason: str, text: str) -> str:
    """The kind of an environment error: its reason and its text up to the first colon.

    For example `env_error: calculator-arithmetic.step raised ToolError`.
    """
    head = text.split(":", 1)[0].strip()
    return f"{reason}: {head}" if head else reason


def _log_new_kinds(batch: Batch, faults: torch.Tensor, policy: str) -> None:
    """Logs the first error of each kind this process sees, with its whole text."""
    texts = batch["agent_error"] if "agent_error" in batch else [""] * len(batch)
    for i in faults.nonzero().flatten().tolist():
        reason, text = batch["finish_reason"][i], texts[i]
        kind = error_kind(reason, text)
        with _logged_lock:
            if kind in _logged_kinds:
                continue
            _logged_kinds.add(kind)
        example = batch["example"][i] if "example" in batch else None
        log.warning(
            "environment error (%s) in sample %d, %s: %s — "
            "rollout.agent.on_env_error=%s %s; later errors of this kind are only counted "
            "(metric agent/env_errors).", kind, int(batch.sample_id[i]),
            dataset_row(example), text or "(no text)", policy,
            {"drop_group": "leaves its whole group out of training",
             "mask": "leaves this trajectory out of training and of its group's baseline",
             "train": "trains on it anyway"}[policy])


def failure_exclusions(batch: Batch, env_policy: str, reward_policy: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which samples the policies leave out: (for the environment's, for the reward's).

    Args:
        batch: Whole groups of samples.
        env_policy: `rollout.agent.on_env_error` (`train` for runs without agents).
        reward_policy: `task.reward_limits.on_failure`.

    Raises:
        ValueError: a policy is not one of `POLICIES`.
    """
    return (excluded_samples(batch, env_faults(batch), env_policy),
            excluded_samples(batch, reward_failures(batch), reward_policy,
                             "task.reward_limits.on_failure"))


def apply_failure_policies(batch: Batch, env_policy: str,
                           reward_policy: str) -> torch.Tensor:  # [num_samples] bool
    """Marks the samples the policies leave out, in place; returns which are kept.

    Sets `env_excluded` (the environment policy's) and clears every left-out sample's
    `train_mask` (kept samples keep theirs). Logs the first environment error of each kind.
    """
    env_excluded, reward_excluded = failure_exclusions(batch, env_policy, reward_policy)
    _log_new_kinds(batch, env_faults(batch), env_policy)
    batch.set(ENV_EXCLUDED, env_excluded)
    excluded = env_excluded | reward_excluded
    if bool(excluded.any()):
        keep = batch["train_mask"].to(torch.bool) if "train_mask" in batch else (
            torch.ones(len(batch), dtype=torch.bool))
        batch.set("train_mask", keep & ~excluded)
    return ~excluded


def estimate_advantages(estimator: Any, batch: Batch,
                        keep: torch.Tensor) -> Mapping[str, RaggedField | torch.Tensor]:
    """The estimator's outputs over the `keep` samples only; 0 for the others.

    The left-out samples take part in no statistic the estimator computes (group mean and
    std, batch whitening). Every rank calls the estimator once, with its kept samples
    (possibly none), so estimators that reduce over a process group stay in step.
    """
    if bool(keep.all()):
        return estimator.compute(batch)
    index = keep.nonzero().flatten()
    part = estimator.compute(batch.select(index))
    return {name: _spread(column, index, batch) for name, column in part.items()}


def _spread(column: RaggedField | torch.Tensor, index: torch.Tensor,
            batch: Batch) -> RaggedField | torch.Tensor:
    """A column of the kept samples (`index`) widened to the batch, zeros elsewhere."""
    if isinstance(column, torch.Tensor):  # [kept samples, ...]
        full = torch.zeros((len(batch), *column.shape[1:]), dtype=column.dtype)
        full[index] = column
        return full
    dtype = column.values.dtype
    rows = [torch.zeros(int(n), dtype=dtype) for n in batch.lengths("response_ids")]
    for i, row in zip(index.tolist(), column.rows()):
        rows[i] = row
    return RaggedField.from_tensors(rows, dtype=dtype)
