"""Every algorithm runs end to end: one process, the real hf + fsdp engines, 2 steps."""

from __future__ import annotations

import pytest

from peerflow.worker.main import run_worker
from tests.helpers import flaky_grader

FLAKY_GRADER = flaky_grader.__file__

CASES = {
    "grpo": ([], ["advantages/mean"]),
    "dr_grpo": (["algorithm.options.grpo.unbiased=true"], ["advantages/mean"]),
    "gae_critic_ppo_graph": (["workflow.graph=ppo", "algorithm.advantage=gae"],
                             ["time/values", "time/train_critic"]),
    "rloo": (["algorithm.advantage=rloo"], ["advantages/mean"]),
    "reinforce_pp": (["algorithm.advantage=reinforce_pp"], ["advantages/mean"]),
    "ppo_clip_clip_higher": (["algorithm.options.ppo_clip.clip_high=0.28",
                              "algorithm.options.ppo_clip.aggregation=token-mean"],
                             ["actor/clipfrac"]),
    "gspo": (["algorithm.loss=gspo"], ["time/train_actor"]),
    "kl_loss": (["algorithm.kl.coef=0.05", "algorithm.kl.mode=loss"],
                ["time/ref_logprob", "kl/mean"]),
    "kl_reward": (["algorithm.kl.coef=0.05", "algorithm.kl.mode=reward"],
                  ["time/ref_logprob", "kl/mean", "score/mean"]),
    "dynamic_sampling": (["algorithm.dynamic_sampling=true"],
                         ["dynamic_sampling/dropped_groups", "dynamic_sampling/refill_rounds"]),
    "dapo_overlong": (["rollout.sampling.max_tokens=6", "algorithm.overlong.buffer=2",
                       "algorithm.overlong.filter=true"],
                      ["overlong/penalty_mean", "overlong/filtered_fraction", "score/mean"]),
    "stale_mis": (["weight_sync.every=2", "algorithm.off_policy.correction=mis"],
                  ["off_policy/masked_fraction", "off_policy/is_weight_max", "mismatch/kl"]),
    # agent episodes, every other dataset row's environment broken: on_env_error=mask
    # leaves those trajectories out of the actor's and the critic's step
    "gae_agent_env_errors": (["workflow.graph=ppo", "algorithm.advantage=gae",
                              "rollout.agent.environment=retry", "rollout.agent.max_turns=2",
                              "rollout.agent.max_total_tokens=24",
                              "rollout.agent.options.broken_every=2",
                              "rollout.agent.on_env_error=mask"],
                             ["time/train_critic", "agent/env_errors",
                              "agent/env_dropped_fraction", "actor/masked_fraction"]),
    # dynamic sampling refills the groups a failure policy leaves out (a grader that is
    # down for some answers, on_failure=drop_group), at a sampling temperature other than 1
    "dynamic_sampling_failed_rewards": (["algorithm.dynamic_sampling=true",
                                         "rollout.sampling.temperature=0.7",
                                         f"task.reward={FLAKY_GRADER}:score",
                                         "task.reward_limits.on_failure=drop_group"],
                                        ["reward/errors", "dynamic_sampling/dropped_groups",
                                         "dynamic_sampling/topped_up_groups"]),
    # trainer, old-policy and reference forwards all score at the sampling temperature
    "temperature_top_p_kl": (["rollout.sampling.temperature=0.7", "rollout.sampling.top_p=0.9",
                              "algorithm.kl.coef=0.05", "algorithm.kl.mode=loss"],
                             ["kl/mean", "mismatch/kl"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_algorithm_smoke(case, tmp_path, monkeypatch, quickstart, tiny, metrics_of):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    overrides, expected = CASES[case]
    run_dir = tmp_path / "run"
    run_worker(quickstart, [*tiny, "runtime.nprocs=1", *overrides], str(run_dir))
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert 0.0 <= m.get("score/mean", m["reward/mean"]) <= 1.0  # the raw task reward
        assert m["samples"] == 16
        assert m["tokens/response"] > 0
        for name in expected:
            assert name in m, f"{case}: {name} missing from {sorted(m)}"
    # the policy was updated: the actor reported a finite gradient norm every step
    assert all(m["actor/grad_norm"] == m["actor/grad_norm"] for m in lines)
    assert all(m["actor/entropy"] > 0 and "actor/loss" in m for m in lines)
    # step 1 samples with the trainer's own weights: rollout and trainer agree
    assert lines[0]["mismatch/abs_max"] < 1e-4
    if case == "gae_agent_env_errors":  # exactly the failed trajectories were left out
        assert sum(m["agent/env_errors"] for m in lines) > 0
        for m in lines:
            assert m["agent/env_dropped_fraction"] == pytest.approx(m["agent/env_errors"] / 16)
            assert m["actor/masked_fraction"] == pytest.approx(m["agent/env_dropped_fraction"])
    if case == "dynamic_sampling_failed_rewards":  # no failed group is trained: the only
        # samples left out are the flat groups that top the batch up once refills run out
        assert sum(m["reward/errors"] for m in lines) > 0
        for m in lines:
            assert m.get("actor/masked_fraction", 0.0) == pytest.approx(
                m["dynamic_sampling/topped_up_groups"] * 4 / 16)
    if case == "stale_mis":  # step 2's samples come from the weights before step 1's update
        assert lines[1]["mismatch/abs_max"] > 1e-4
