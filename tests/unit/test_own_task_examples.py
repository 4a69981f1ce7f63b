"""The bring-your-own-task examples: configs validate, shipped data is right."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from peerflow.config import load_config, validate_config
from peerflow.contrib.tasks.dataset import DatasetOptions, DatasetTask
from peerflow.rewards.code import code_reward

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["custom_reward", "code_reward", "chat_parquet"])
def test_example_configs_validate(name, plugin_manager, monkeypatch):
    monkeypatch.chdir(ROOT)
    validate_config(load_config(f"examples/{name}.yaml"), plugin_manager)


def test_every_code_task_has_a_passing_reference_solution():
    rows = [json.loads(line) for line in
            (ROOT / "examples/data/code_tasks.jsonl").read_text().splitlines()]
    assert len(rows) == 10
    for row in rows:
        assert code_reward(f"```python\n{row['solution']}\n```", row) == {
            "score": 1.0, "all_passed": 1.0}, row["prompt"]
        assert code_reward("print('no')", row)["score"] < 1.0


def test_chat_parquet_script_writes_the_shipped_file(tmp_path):
    script = runpy.run_path(str(ROOT / "examples/make_chat_parquet.py"))
    fresh = script["write"](tmp_path / "chat.parquet", 2000)
    options = dict(prompt_column="prompt", answer_column="reward_model.ground_truth",
                   shuffle=False)
    shipped = DatasetTask(DatasetOptions(path=str(ROOT / "examples/data/chat_arithmetic.parquet"),
                                         **options))
    regenerated = DatasetTask(DatasetOptions(path=str(fresh), **options))
    assert list(shipped.examples("train", 0)) == list(regenerated.examples("train", 0))
    first = next(shipped.examples("train", 0))
    a, b = first.prompt[0]["content"].rstrip("=").split("+")
    assert first.answer == str(int(a) + int(b))
    assert first.metadata["data_source"] == "peerflow/chat-arithmetic"
