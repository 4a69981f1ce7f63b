"""Outcomes that used to pass in silence or contradict each other (issue 36 items 4, 5).

* a resume with nothing to run says "already at step N" and how to go further, without
  starting a worker;
* a run that stopped before its first checkpoint is retried in place by one command, and
  every message names that same command;
* a refused start leaves no fork server behind (it returns in the time validation takes
  and holds nobody's stdout);
* a dataset row without a prompt is named by its 1-based line, not `<object object …>`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import peerflow.launch
from peerflow.checkpoint.manifest import write_manifest
from peerflow.cli import main
from peerflow.cli.train_cmd import resume_hint
from tests.helpers.configs import QUICKSTART, started_run_dir


@pytest.fixture
def run_dir(tmp_path):
    return started_run_dir(tmp_path)


@pytest.fixture
def launches(monkeypatch):
    """Records every `launch` call instead of starting workers."""
    calls = []
    monkeypatch.setattr(peerflow.launch, "launch", lambda **kw: calls.append(kw) or 0)
    return calls


def _checkpoint(run_dir: Path, step: int, *, finished: bool = True) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    if finished:  # a saved (verifiable) checkpoint: one payload file and its manifest
        (path / "actor").mkdir()
        (path / "actor" / "state.json").write_text("{}")
        write_manifest(path, step=step)
    return path


def test_a_resume_with_nothing_to_do_says_already_at_step_n(run_dir, launches, capsys):
    _checkpoint(run_dir, 5)
    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=5"]) == 0
    out = capsys.readouterr().out
    assert f"{run_dir} is already at step 5 (run.steps=5); nothing to do" in out
    assert "--set run.steps=10" in out  # how to train further
    assert launches == []  # no worker started
    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=7"]) == 0
    assert launches[-1]["resume"] == str(run_dir)


def test_a_run_that_stopped_before_its_first_checkpoint_is_retried_by_one_command(
        run_dir, launches, capsys):
    unfinished = _checkpoint(run_dir, 2, finished=False)
    command = f"peerflow train --resume {run_dir}"
    assert main(["train", QUICKSTART, "--run-dir", str(run_dir)]) == 1  # a fresh start
    assert command in capsys.readouterr().err
    assert command in resume_hint(run_dir)  # what a failed or stopped run prints
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert "starting" in capsys.readouterr().err
    assert launches[-1]["resume"] is None  # from step 0, in the same directory
    assert launches[-1]["run_dir"] == str(run_dir)
    assert not unfinished.exists()  # nothing loadable was lost


def test_a_refused_start_starts_no_fork_server(tmp_path, monkeypatch, capsys):
    """The fork server starts once validation passed: a refused start returns in the time
    validation takes, and nothing is left holding the caller's stdout."""
    import yaml

    import peerflow.launch.warm as warm

    started = []
    monkeypatch.setattr(warm, "start_warm_server", lambda: started.append(1) or False)
    config = yaml.safe_load(Path(QUICKSTART).read_text())
    config["run"]["stepz"] = 3  # a typo
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 1
    assert "run.stepz: unknown key" in capsys.readouterr().err
    assert started == []


def test_a_row_without_a_prompt_names_its_line(tmp_path):
    from peerflow.contrib.tasks.dataset import DatasetOptions, DatasetTask
    from peerflow.errors import ConfigError

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n\n"
                    + json.dumps({"question": "3+3?", "answer": "6"}) + "\n")
    with pytest.raises(ConfigError) as caught:
        DatasetTask(DatasetOptions(path=str(data))).size("train")
    text = str(caught.value)
    assert "object object" not in text
    assert f"{data}: line 3: column 'prompt' is missing" in text, text
