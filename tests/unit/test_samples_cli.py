"""`peerflow samples`: reading, ordering and printing `RUN_DIR/samples/*.jsonl`, and the
merge of every rank's picks."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from peerflow.batch import Batch
from peerflow.cli import main
from peerflow.outputs.samples import (
    describe_steps,
    order_samples,
    read_samples,
    render_samples,
    sample_steps,
    write_samples,
)
from peerflow.ragged import RaggedField
from peerflow.worker.samples import merge_records, sample_records


def _sample(sample_id: int, reward: float | None, **extra) -> dict:
    return {"step": 3, "sample_id": sample_id, "group_id": sample_id // 2,
            "prompt": f"What is {sample_id} + 1?", "response": f"answer {sample_id + 1}",
            "reward": reward, "components": {"accuracy": reward or 0.0}, "advantage": 0.25,
            "finish_reason": "stop", "response_tokens": 5, **extra}


@pytest.fixture
def run_dir(tmp_path):
    for step in (1, 2, 3, 5):
        write_samples(tmp_path, step, [_sample(i, r) for i, r in
                                       enumerate([0.5, 1.0, None, 0.0])])
    write_samples(tmp_path, 0, [{**_sample(0, 1.0), "mode": "greedy"}], evaluation=True)
    return tmp_path


def test_steps_are_listed_and_described(run_dir):
    assert sample_steps(run_dir) == [1, 2, 3, 5]
    assert sample_steps(run_dir, evaluation=True) == [0]
    assert describe_steps([5, 1, 2, 3, 9, 10]) == "1-3, 5, 9-10"
    assert not list((run_dir / "samples").glob(".*"))  # no temporaries left


def test_read_newest_or_named_step(run_dir):
    assert read_samples(run_dir)[0] == 5
    step, samples = read_samples(run_dir, 2)
    assert step == 2 and [s["sample_id"] for s in samples] == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError, match=r"no samples for step 4 .*steps with samples: "
                       r"1-3, 5"):
        read_samples(run_dir, 4)


def test_run_without_samples_names_the_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"set run.samples_per_step > 0"):
        read_samples(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_samples(tmp_path / "missing")


def test_worst_and_best_order_by_reward_unscored_last():
    samples = [_sample(i, r) for i, r in enumerate([0.5, 1.0, None, 0.0])]
    assert [s["sample_id"] for s in order_samples(samples, worst=True)] == [3, 0, 1, 2]
    assert [s["sample_id"] for s in order_samples(samples, best=True)] == [1, 0, 3, 2]
    assert [s["sample_id"] for s in order_samples(samples, best=True, limit=2)] == [1, 0]
    assert [s["sample_id"] for s in order_samples(samples)] == [0, 1, 2, 3]


def test_render_shows_numbers_prompt_and_response():
    out = io.StringIO()
    render_samples([_sample(7, 0.5, num_turns=3)], step=3, header=", lowest reward first",
                   console=Console(file=out, width=100, color_system=None))
    text = out.getvalue()
    assert "step 3: 1 sample, lowest reward first" in text
    assert "sample 7 · group 3 · reward 0.500" in text
    assert "accuracy 0.500 · advantage +0.250 · 5 tokens, stop · 3 turns" in text
    assert "What is 7 + 1?" in text and "answer 8" in text


def test_cli_json_and_errors(run_dir, capsys):
    assert main(["samples", str(run_dir), "--step", "1", "--worst", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["reward"] for s in shown] == [0.0, 0.5, 1.0, None]
    assert main(["samples", str(run_dir), "--step", "7"]) == 1
    assert "steps with samples: 1-3, 5" in capsys.readouterr().err
    assert main(["samples", str(run_dir), "--eval"]) == 0
    assert "step 0: 1 sample (evaluation)" in capsys.readouterr().out


class _Tokenizer:
    def batch_decode(self, rows, skip_special_tokens):
        return [" ".join(map(str, row)) for row in rows]


def _batch(ids: list[int]) -> Batch:
    batch = Batch(sample_id=torch.tensor(ids), group_id=torch.tensor([i // 2 for i in ids]),
                  weight_version=torch.zeros(len(ids), dtype=torch.int64))
    batch.set("prompt_ids", RaggedField.from_lists([[1, i] for i in ids], torch.int64))
    batch.set("response_ids", RaggedField.from_lists([[i] * (1 + i % 2) for i in ids],
                                                     torch.int64))
    batch.set("reward", torch.tensor([float(i % 2) for i in ids]))
    batch.set_objects("finish_reason", ["stop"] * len(ids))
    return batch


def test_each_rank_decodes_its_first_samples_and_merge_keeps_the_run_first():
    rank0 = _batch([6, 2, 4])
    rank0.set("advantages", RaggedField.from_lists([[1.0], [0.5], [-1.0]], torch.float32))
    records0 = sample_records(rank0, _Tokenizer(), 3, limit=2)
    assert [(r["sample_id"], r["prompt"], r["advantage"]) for r in records0] == [
        (2, "1 2", 0.5), (4, "1 4", -1.0)]
    records1 = sample_records(_batch([5, 1, 3]), _Tokenizer(), 3, limit=2)
    assert records1[0]["advantage"] is None and records1[0]["response_tokens"] == 2
    replica = sample_records(rank0, _Tokenizer(), 3, limit=2)
    merged = merge_records([records0, records1, replica], limit=3)
    assert [r["sample_id"] for r in merged] == [1, 2, 3]
    assert len(merge_records([records0], limit=8)) == 2  # fewer than the limit: all
