"""A resume knows what changed: the dataset's size and SHA-256 are fingerprinted (a changed
dataset is refused unless `--allow-change task`), and a changed reward file is reported in
one line and recorded in the run directory (issue 36 item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peerflow.checkpoint.fingerprint import check_resume, fingerprint
from peerflow.config import load_config
from peerflow.errors import ConfigError
from peerflow.outputs import write_resolved_config

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")


def _config(data: Path, reward: Path):
    return load_config(QUICKSTART, ["task.name=dataset", f"task.options={{path: {data}}}",
                                    f"task.reward={reward}:score"])


@pytest.fixture
def run(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    reward = tmp_path / "reward.py"
    reward.write_text("def score(response, example):\n    return 1.0\n")
    run_dir = tmp_path / "run"
    write_resolved_config(run_dir, _config(data, reward))
    return run_dir, data, reward


def test_the_fingerprint_records_the_datasets_size_and_sha256(run):
    run_dir, data, reward = run
    recorded = json.loads((run_dir / "fingerprint.json").read_text())
    assert recorded["task.data.path.size"] == data.stat().st_size
    assert len(recorded["task.data.path.sha256"]) == 64
    assert f"reward_file.{reward.resolve()}.sha256" in recorded


def test_a_changed_dataset_is_refused_unless_allowed(run):
    run_dir, data, reward = run
    data.write_text(data.read_text().splitlines(keepends=True)[0])  # rows removed
    with pytest.raises(ConfigError) as caught:
        check_resume(run_dir, _config(data, reward))
    text = str(caught.value)
    assert "task.data.path.sha256: run has" in text and "task.data.path.size" in text
    assert "The dataset changed (task.options path)" in text
    assert "--allow-change task" in text
    check_resume(run_dir, _config(data, reward), ["task"])  # on purpose: allowed


def test_a_changed_reward_file_is_reported_in_one_line_and_recorded(run):
    run_dir, data, reward = run
    reward.write_text("def score(response, example):\n    return 0.5\n")
    lines = []
    check_resume(run_dir, _config(data, reward), report=lines.append)  # not refused
    assert len(lines) == 1 and str(reward.resolve()) in lines[0], lines
    assert "changes.jsonl" in lines[0]
    record = json.loads((run_dir / "changes.jsonl").read_text().splitlines()[-1])
    changed = record["changed"][f"reward_file.{reward.resolve()}.sha256"]
    assert changed["run"] != changed["resume"]
    assert fingerprint(_config(data, reward))[f"reward_file.{reward.resolve()}.sha256"] \
        == changed["resume"]
