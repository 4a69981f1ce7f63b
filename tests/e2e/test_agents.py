"""`peerflow train` with multi-turn agent episodes (`rollout.agent`), sync and async.

The `retry` environment on the quickstart task: a wrong answer gets the prompt again, up
to `max_turns` turns. Token exactness end to end: in sync mode the trainer's log-probs of
the sampled tokens equal the rollout's (`mismatch/*` counts model tokens only).
"""

from __future__ import annotations

import pytest

from tests.helpers.configs import ASYNC_SPLIT_PAIR

pytestmark = pytest.mark.distributed

AGENT = ["rollout.agent.environment=retry", "rollout.agent.max_turns=3",
         "rollout.agent.max_total_tokens=24", "rollout.agent.options.turn_discount=0.5"]
FINISHES = ("stop", "max_turns", "max_tokens", "env_error", "env_timeout")


def _check_episodes(row: dict) -> None:
    assert 1 <= row["agent/turns_mean"] <= row["agent/turns_max"] <= 3
    assert sum(row[f"agent/finish/{r}"] for r in FINISHES) == pytest.approx(1.0)
    assert row["agent/finish/env_error"] == row["agent/finish/env_timeout"] == 0
    assert row["samples"] == 16 and 0.0 <= row["reward/mean"] <= 1.0
    if row["agent/finish/stop"] < 1:  # someone retried: the prompt came back as tokens
        assert row["agent/observation_tokens"] > 0
    # response_length counts sampled tokens, tokens/response every token
    assert row["response_length/mean"] * 16 <= row["tokens/response"]


def test_sync_agent_run(tmp_path, quickstart, tiny, metrics_of, peerflow_train):
    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*tiny, *AGENT, "run.steps=2", "run.eval_every=2", "eval.n=2",
                    "eval.max_prompts=4"])
    rows = metrics_of(run_dir)
    assert [m["step"] for m in rows] == [0, 1, 2]  # step 0: the evaluation before training
    for row in (rows[0], rows[2]):  # evaluation runs episodes too (greedy and sampled)
        assert row["eval/prompts"] == 4 and 0 <= row["eval/sampled/reward"] <= 1
    for row in rows[1:]:
        _check_episodes(row)
        assert row["agent/versions_max"] == 1
        # token exactness: the trainer scores the sampled tokens as the rollout did
        assert row["mismatch/abs_max"] < 1e-4


def test_async_agent_run_under_the_staleness_bound(tmp_path, quickstart, tiny, metrics_of,
                                                   peerflow_train):
    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*tiny, *AGENT, *ASYNC_SPLIT_PAIR, "run.steps=3",
                    "runtime.async_prompts_per_call=1",
                    "trainer.lr=0.05", "rollout.agent.options.step_delay_s=0.05"])
    rows = metrics_of(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for row in rows:
        _check_episodes(row)
        assert row["staleness/max"] <= 1
        # a trajectory's turns may span the versions applied between them, never more
        # than the staleness bound allows
        assert 1 <= row["agent/versions_max"] <= 2


def test_timing_out_environment_ends_its_trajectories_and_the_run_goes_on(
        tmp_path, quickstart, tiny, metrics_of, peerflow_train):
    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*tiny, *AGENT, "run.steps=2", "rollout.agent.options.step_delay_s=5",
                    "rollout.agent.step_timeout_s=0.2"])
    rows = metrics_of(run_dir)
    assert [m["step"] for m in rows] == [1, 2]
    for row in rows:
        assert row["agent/finish/env_timeout"] == 1.0 and row["agent/turns_mean"] == 1
        assert row["agent/observation_tokens"] == 0 and row["samples"] == 16
        # every trajectory failed: the default on_env_error=drop_group leaves all out and
        # the step trains nothing (skipped, no division by zero)
        assert row["agent/env_errors"] == 16 and row["agent/env_dropped_fraction"] == 1.0
        assert row["actor/masked_fraction"] == 1.0 and row["actor/loss"] == 0.0


def test_async_run_leaves_the_groups_of_a_broken_environment_out(
        tmp_path, quickstart, tiny, metrics_of, peerflow_train):
    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*tiny, *AGENT, *ASYNC_SPLIT_PAIR, "run.steps=3",
                    "rollout.agent.options.broken_every=2"])
    rows = metrics_of(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for row in rows:
        assert row["samples"] == 16  # no trajectory lost, failed or not
        failed = row["agent/finish/env_error"]
        assert row["agent/env_errors"] == pytest.approx(16 * failed)
        # a broken row fails all its trajectories: exactly their groups are left out
        assert row["agent/env_dropped_fraction"] == pytest.approx(failed)
        assert row["actor/masked_fraction"] == pytest.approx(failed)
    assert sum(row["agent/env_errors"] for row in rows) > 0
