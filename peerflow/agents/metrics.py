"""Metrics of a batch of agent episodes (`agent/*`), recorded by the step's metrics."""

from __future__ import annotations

from typing import Any

from peerflow.batch import LOSS_MASK, Batch
from peerflow.streaming.versions import TOKEN_VERSIONS

#: Every `finish_reason` an episode can end with (metrics `agent/finish/<reason>`).
FINISH_REASONS = ("stop", "max_turns", "max_tokens", "env_error", "env_timeout", "restart",
                  "branch")


def record_episode_metrics(batch: Batch, metrics: Any) -> None:
    """Records `agent/*` metrics of a batch of episodes into a `StepMetrics`.

    Turns, how episodes ended, environment failures (`agent/env_errors`: how many;
    `agent/env_dropped_fraction`: the fraction of samples `rollout.agent.on_env_error`
    left out of training), observation tokens, weight versions per trajectory
    (`agent/versions_max`: most versions one trajectory's sampled tokens span), and the
    per-trajectory mean of every number environments put in `StepResult.info`.
    """
    from peerflow.algorithms.failed_samples import ENV_EXCLUDED, env_faults

    n = len(batch)
    turns = batch["num_turns"].float()
    metrics.mean("agent/turns_mean", float(turns.mean()), n)
    metrics.max("agent/turns_max", float(turns.max()))
    reasons = batch["finish_reason"]
    for reason in FINISH_REASONS:
        metrics.mean(f"agent/finish/{reason}", sum(r == reason for r in reasons) / n, n)
    metrics.sum("agent/env_errors", float(env_faults(batch).sum()))
    if ENV_EXCLUDED in batch:
        metrics.mean("agent/env_dropped_fraction",
                     float(batch[ENV_EXCLUDED].double().mean()), n)
    mask = batch.ragged(LOSS_MASK)
    metrics.sum("agent/observation_tokens", float((~mask.values).sum()))
    turn_rewards = batch.ragged("token_rewards")
    metrics.mean("agent/turn_reward_mean", float(turn_rewards.values.sum()) / n, n)
    if TOKEN_VERSIONS in batch:
        spans = [len(set(v[m].tolist())) for v, m in zip(batch.ragged(TOKEN_VERSIONS).rows(),
                                                         mask.rows())]
        metrics.max("agent/versions_max", float(max(spans, default=0)))
    infos = batch["agent_info"] if "agent_info" in batch else []
    for key in sorted({k for info in infos for k in info}):
        metrics.mean(f"agent/{key}", sum(info.get(key, 0.0) for info in infos) / n, n)
