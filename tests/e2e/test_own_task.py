"""Bring your own task: evaluation during training, `peerflow eval`, `peerflow.train`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import peerflow
from peerflow.errors import ConfigError

pytestmark = pytest.mark.distributed

EVAL = ["run.eval_every=2", "eval.n=2", "eval.max_prompts=4", "run.checkpoint_every=0"]


def test_eval_before_every_k_and_at_the_end(tmp_path, quickstart, tiny, metrics_of,
                                            peerflow_train):
    from peerflow.outputs.report import render_report

    run_dir = tmp_path / "run"
    proc = peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                          [*tiny, "run.steps=3", *EVAL])
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    # each evaluation prints its line; the summary gives the first and the last
    printed = [line for line in proc.stderr.splitlines() if line.startswith("eval ")]
    assert [line.split()[1] for line in printed] == ["0/3", "2/3", "3/3"], proc.stderr
    for line in printed:
        assert re.fullmatch(r"eval \d/3  greedy [\d.e-]+  sampled [\d.e-]+  pass@1 [\d.e-]+  "
                            r"pass@2 [\d.e-]+  len [\d.e-]+", line), line
    assert re.search(r"eval +greedy reward [\d.e-]+ → [\d.e-]+, sampled reward [\d.e-]+ → "
                     r"[\d.e-]+, pass@2 [\d.e-]+ \(step 0 → 3\)", proc.stderr), proc.stderr
    evaluated = {m["step"]: m for m in lines if "eval/greedy/reward" in m}
    assert sorted(evaluated) == [0, 2, 3]
    for m in evaluated.values():
        assert m["eval/prompts"] == 4
        assert 0.0 <= m["eval/greedy/reward"] <= 1.0 and 0.0 <= m["eval/sampled/reward"] <= 1
        assert 0.0 <= m["eval/pass@1"] <= m["eval/pass@2"] <= 1.0
        assert m["eval/greedy/errors"] == 0 and m["eval/greedy/timeouts"] == 0
    assert "reward/mean" in lines[1] and "reward/mean" not in lines[0]
    written = {p.name for p in render_report(run_dir)}
    assert {"eval.png", "reward.png"} <= written

    # `peerflow eval` on the final checkpoint reproduces the in-training evaluation, and
    # writes nothing into the training run (its logs stay as training left them)
    logs = {p.name: p.read_bytes() for p in (run_dir / "logs").iterdir()}
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "peerflow", "eval", quickstart, "--checkpoint", str(run_dir),
         "--out", str(out), "--nprocs", "2", *[a for o in [*tiny, *EVAL]
                                               for a in ("--set", o)]],
        capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "eval.json").read_text())
    assert result["step"] == 3 and json.loads(proc.stdout)["step"] == 3
    for name in ("eval/greedy/reward", "eval/sampled/reward", "eval/pass@2"):
        assert result["metrics"][name] == pytest.approx(evaluated[3][name])
    assert {p.name: p.read_bytes() for p in (run_dir / "logs").iterdir()} == logs
    assert (out / "logs" / "rank1.log").is_file()
    # a checkpoint another train engine wrote is refused before any worker starts
    from peerflow.api import evaluate
    from peerflow.errors import ConfigError

    with pytest.raises(ConfigError, match="was written by trainer.backend='fsdp'.*"
                                          "--set trainer.backend=fsdp"):
        evaluate(quickstart, checkpoint=run_dir, overrides=[*tiny, *EVAL,
                                                            "trainer.backend=deepspeed"])


REWARD = '''
def digits_right(response, example):
    """Partial credit per position, plus a length metric."""
    answer = str(example["answer"])
    hits = sum(a == b for a, b in zip(response.strip(), answer))
    return {"score": hits / len(answer), "length": len(response)}
'''


def test_python_entry_point_with_a_reward_function(tmp_path, quickstart, tiny, metrics_of,
                                                   monkeypatch):
    from peerflow.rewards.loading import load_function, parse_target

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "scoring.py").write_text(REWARD)
    score = load_function(parse_target(f"{tmp_path / 'scoring.py'}:digits_right"))
    with pytest.raises(ConfigError, match="lambda"):
        peerflow.train(quickstart, tiny, reward_fn=lambda r, e: 1.0)
    run_dir = peerflow.train(quickstart, overrides=[*tiny, "run.steps=2"], reward_fn=score,
                             run_dir=tmp_path / "run", nprocs=1)
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["reward/digits_right/mean"] == pytest.approx(m["reward/mean"], abs=1e-6)
        assert m["reward/digits_right/length"] > 0
        assert m["reward/errors"] == 0 and m["reward/timeouts"] == 0
