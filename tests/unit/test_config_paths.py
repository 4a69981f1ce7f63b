"""Relative paths resolve from the config file's directory; `--set` ones from the working
directory (issue 33, ranked item 8)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from peerflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
model: {path: models/tiny}
task:
  name: dataset
  options: {path: data/train.jsonl, eval_path: ../shared/eval.jsonl, prompt_column: prompt}
  rewards:
    - {fn: my_rewards.py:score}
    - {fn: exact_match}
    - {fn: "peerflow.contrib.rewards:exact_match"}
    - {fn: /abs/rewards.py:other}
workflow: {nodes: [{name: reward, options: {reward: my_rewards.py:score}}]}
run: {trackers: {mlflow: {tracking_uri: mlruns}}}
"""


def test_paths_in_a_file_resolve_from_its_directory(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "task.yaml").write_text(CONFIG)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("..") / "project" / "task.yaml")
    assert config.model.path == str(elsewhere / ".." / "project" / "models" / "tiny")
    options = config.task.options
    assert Path(options["path"]).resolve() == project / "data" / "train.jsonl"
    assert Path(options["eval_path"]).resolve() == tmp_path / "shared" / "eval.jsonl"
    assert options["prompt_column"] == "prompt"
    file_fn, registered, module_fn, absolute = (r.fn for r in config.task.rewards)
    path, _, function = file_fn.rpartition(":")
    assert Path(path).resolve() == project / "my_rewards.py" and function == "score"
    assert (registered, module_fn) == ("exact_match", "peerflow.contrib.rewards:exact_match")
    assert absolute == "/abs/rewards.py:other"
    node_reward = config.workflow.nodes[0].options["reward"]
    assert Path(node_reward.rpartition(":")[0]).resolve() == project / "my_rewards.py"
    assert Path(config.run.trackers.mlflow.tracking_uri).resolve() == project / "mlruns"


def test_set_overrides_resolve_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "task.yaml").write_text(CONFIG)
    monkeypatch.chdir(ROOT)
    config = load_config(tmp_path / "task.yaml", ["task.options.path=mine.jsonl",
                                                  "task.reward=here.py:fn", "task.rewards=[]"])
    assert config.task.options["path"] == str(ROOT / "mine.jsonl")
    assert config.task.reward == f"{ROOT / 'here.py'}:fn"
    assert config.model.path == str(tmp_path / "models" / "tiny")


@pytest.mark.parametrize("name", ["custom_reward", "chat_parquet"])
def test_examples_open_their_files_from_any_directory(name, tmp_path, monkeypatch):
    from peerflow.cli.config_cmd import load_validated

    monkeypatch.chdir(tmp_path)
    load_validated(argparse.Namespace(config=str(ROOT / "examples" / f"{name}.yaml"),
                                      overrides=[]))
