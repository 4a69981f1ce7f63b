"""Samples a 2-process run writes (`samples/step_N.jsonl`, `eval_step_N.jsonl`), and
`peerflow samples` reading them."""

from __future__ import annotations

import json

import pytest

from peerflow.cli import main

pytestmark = pytest.mark.distributed

FIELDS = {"step", "sample_id", "group_id", "prompt", "response", "reward", "components",
          "advantage", "finish_reason", "response_tokens"}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_writes_its_first_samples(quickstart_run, capsys):
    """The shared run (16 samples a step, default run.samples_per_step 8) and the CLI."""
    run_dir = quickstart_run
    for step in (1, 2, 3, 4):
        samples = _lines(run_dir / "samples" / f"step_{step}.jsonl")
        assert len(samples) == 8
        assert [s["sample_id"] for s in samples] == sorted(s["sample_id"] for s in samples)
        for s in samples:
            assert set(s) == FIELDS, set(s) ^ FIELDS
            assert s["step"] == step
            assert isinstance(s["prompt"], str) and s["prompt"].strip()
            assert isinstance(s["response"], str)
            assert 0.0 <= s["reward"] <= 1.0
            assert set(s["components"]) and all(0 <= v <= 1 for v in s["components"].values())
            assert isinstance(s["advantage"], float)
            assert 1 <= s["response_tokens"] <= 4 and s["finish_reason"]
    assert main(["samples", str(run_dir), "--worst", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["step"] for s in shown] == [4] * 8
    assert [s["reward"] for s in shown] == sorted(s["reward"] for s in shown)
    assert main(["samples", str(run_dir), "--step", "2", "--best", "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "step 2: 3 samples, highest reward first" in out and "response" in out
    assert main(["samples", str(run_dir), "--step", "99"]) == 1
    err = capsys.readouterr().err
    assert "no samples for step 99" in err and "steps with samples: 1-4" in err


def test_samples_off_and_eval_samples(tmp_path, quickstart, tiny, peerflow_train, capsys):
    """`run.samples_per_step=0` writes no step samples; evaluation writes all of its own."""
    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*tiny, "run.samples_per_step=0", "run.eval_every=2",
                    "eval.max_prompts=4", "eval.n=2"])
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == [
        "eval_step_0.jsonl", "eval_step_2.jsonl"]
    samples = _lines(run_dir / "samples" / "eval_step_2.jsonl")
    assert sorted(s["mode"] for s in samples) == ["greedy"] * 4 + ["sampled"] * 8
    assert all("advantage" not in s and isinstance(s["response"], str) for s in samples)
    assert main(["samples", str(run_dir)]) == 1
    assert "set run.samples_per_step > 0" in capsys.readouterr().err
    assert main(["samples", str(run_dir), "--eval", "--worst"]) == 0
    assert "step 2: 12 samples (evaluation), lowest reward first" in capsys.readouterr().out
