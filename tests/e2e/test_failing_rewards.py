"""A run whose reward fails is loud: it stops when a reward fails on everything, keeps every
failure's traceback, tallies them at the end and exits non-zero past the allowed share."""

from __future__ import annotations

import json

import pytest

from peerflow.errors import PeerFlowError
from peerflow.worker.main import run_worker

REWARDS = '''
def always_raises(response, example):
    return {"answer": example["answer"]}["missing"]


def odd_lengths_raise(completions, examples):
    """Batched: one bad answer used to cost the whole call."""
    if any(len(c) % 2 for c in completions):
        bad = next(c for c in completions if len(c) % 2)
        raise ValueError(f"cannot grade {bad!r}")
    return [1.0 for _ in completions]
'''


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "grader.py").write_text(REWARDS)
    return tmp_path / "grader.py"


def test_a_reward_failing_on_every_sample_stops_the_run(tmp_path, rewards, quickstart, tiny):
    run_dir = tmp_path / "run"
    with pytest.raises(PeerFlowError) as info:  # it used to run to the end, exit 0
        run_worker(quickstart, [*tiny, "runtime.nprocs=1", "run.steps=4",
                                "rollout.sampling.temperature=0.7",
                                f"task.reward={rewards}:always_raises"], str(run_dir))
    message = str(info.value)
    assert type(info.value).__name__ == "RewardFailedError"
    # task.reward_limits.fatal_after_steps: 3 by default
    assert ("reward 'always_raises' failed on every sample of the last 3 steps (up to step 3)"
            in message)
    assert "Sample " in message and "KeyError: 'missing'" in message
    assert 'grader.py", line 3, in always_raises' in message  # the traceback
    steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert steps == [1, 2, 3]  # stopped after step 3 of 4
    errors = [json.loads(line) for line in open(run_dir / "reward_errors.jsonl")]
    assert len(errors) == 3 * 16 and {e["reward"] for e in errors} == {"always_raises"}


def test_reward_errors_are_kept_tallied_and_fail_the_run_past_the_share(tmp_path, rewards,
                                                                       quickstart, tiny):
    run_dir = tmp_path / "run"
    with pytest.raises(PeerFlowError, match="max_failure_share=0.01"):
        run_worker(quickstart, [*tiny, "runtime.nprocs=1", "rollout.sampling.temperature=0.7",
                                "run.checkpoint_every=2", "task.reward_limits.workers=1",
                                f"task.reward={rewards}:odd_lengths_raise",
                                "task.reward_limits.max_failure_share=0.01"], str(run_dir))
    assert (run_dir / "checkpoints" / "step_000002").is_dir()  # finished, then failed
    lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    tally = json.loads((run_dir / "reward_errors.json").read_text())
    failed = sum(m["reward/failed_samples"] for m in lines)
    assert tally["samples"] == 32 and tally["failed_samples"] == failed
    assert 0 < failed < 32 and tally["exceeded"] is True
    assert tally["by_reward"] == {"odd_lengths_raise": failed}
    # the batched call was retried per sample: only the odd-length answers lost their score
    errors = [json.loads(line) for line in open(run_dir / "reward_errors.jsonl")]
    assert len(errors) == failed
    assert all("ValueError: cannot grade" in e["message"] and "Traceback" in e["traceback"]
               for e in errors)
    assert sum(m["reward/odd_lengths_raise/mean"] for m in lines) / 2 == pytest.approx(
        1 - failed / 32)
