"""The one checkpoint layout: atomic writes, manifests, fallback, retention, strict shapes."""

from __future__ import annotations

import json
import random

import pytest
import torch

from peerflow.checkpoint import (
    atomic_path,
    check_shapes,
    list_checkpoints,
    newest_complete,
    newest_verified,
    restore_latest,
    save_step,
    should_checkpoint,
    step_dir,
    truncate_metrics,
    verify,
    write_json_atomic,
)
from peerflow.checkpoint.state import rng_state, set_rng_state
from peerflow.errors import ConfigError


class _Engine:
    """A stand-in train engine whose checkpoint is one safetensors file of its weights."""

    def __init__(self, scale: float) -> None:
        self.weight = torch.arange(12.0).reshape(3, 4) * scale

    def save_checkpoint(self, directory: str) -> None:
        from safetensors.torch import save_file

        with atomic_path(f"{directory}/w.safetensors") as tmp:
            save_file({"w": self.weight}, str(tmp))

    def load_checkpoint(self, directory: str) -> None:
        from safetensors.torch import load_file

        self.weight = load_file(f"{directory}/w.safetensors")["w"]


def _save(run_dir, step, keep_last=0, lines=None):
    engines = {"actor": _Engine(step), "critic": _Engine(-step), "ref": _Engine(0.5)}
    return save_step(run_dir, step, engines=engines, rank=0, keep_last=keep_last,
                     driver_state={"sampler": {"cursor": step}},
                     log=lines.append if lines is not None else print)


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "a" / "x.json"
    write_json_atomic(target, {"k": 1})
    with pytest.raises(RuntimeError, match="boom"), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert json.loads(target.read_text()) == {"k": 1}
    assert [p.name for p in target.parent.iterdir()] == ["x.json"]
    with atomic_path(tmp_path / "dir") as tmp:  # directories too
        tmp.mkdir()
        (tmp / "f").write_text("y")
    assert (tmp_path / "dir" / "f").read_text() == "y"


def test_save_and_restore_every_trainable_role(tmp_path):
    directory = _save(tmp_path, 3)
    names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    assert names == ["MANIFEST.json", "actor/w.safetensors", "critic/w.safetensors",
                     "driver/rank0.json"]  # "ref" is frozen: not saved
    random.seed(7)
    expected = random.random()
    random.seed(7)
    _save(tmp_path, 4)
    engines = {"actor": _Engine(0), "critic": _Engine(0)}
    resumed = restore_latest(tmp_path, engines=engines, rank=0, report=print)
    assert resumed.step == 4 and resumed.driver_state["sampler"] == {"cursor": 4}
    assert torch.equal(engines["actor"].weight, _Engine(4).weight)
    assert torch.equal(engines["critic"].weight, _Engine(-4).weight)
    assert random.random() == expected  # the RNG state is the one saved


def test_truncated_newest_falls_back_naming_file_and_step(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    shard = step_dir(tmp_path, 4) / "critic" / "w.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    lines = []
    resumed = restore_latest(tmp_path, engines={"actor": _Engine(0)}, rank=0,
                             report=lines.append)
    assert resumed.step == 2
    assert "step 4" in lines[0] and "critic/w.safetensors" in lines[0]
    assert "truncated" in lines[0]
    assert "resuming from step 2" in lines[1]
    assert [(i.step, i.status) for i in list_checkpoints(tmp_path, check=True)] == [
        (2, "verified"), (4, "corrupt")]


def test_unfinished_or_tampered_checkpoints_are_not_used(tmp_path):
    _save(tmp_path, 2)
    step_dir(tmp_path, 6).mkdir(parents=True)  # a save interrupted before its manifest
    (step_dir(tmp_path, 6) / "actor").mkdir()
    assert newest_verified(tmp_path, report=lambda _: None).step == 2
    assert newest_complete(tmp_path).step == 2
    driver = step_dir(tmp_path, 2) / "driver" / "rank0.json"
    driver.write_text(driver.read_text().replace('"cursor": 2', '"cursor": 9'))
    assert "checksum" in verify(step_dir(tmp_path, 2)).problem
    assert newest_verified(tmp_path, report=lambda _: None) is None
    assert [i.status for i in list_checkpoints(tmp_path, check=True)] == ["corrupt", "incomplete"]


def test_keep_last_removes_older_checkpoints(tmp_path):
    lines = []
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2, lines=lines)
    assert [i.step for i in list_checkpoints(tmp_path)] == [3, 4]
    assert len(lines) == 2 and "keep_last=2" in lines[0]
    _save(tmp_path, 5)  # keep_last=0 keeps everything
    assert [i.step for i in list_checkpoints(tmp_path)] == [3, 4, 5]


def test_check_shapes_names_every_difference():
    saved = {"embed": [40, 64], "layers.0.w": [64, 64], "layers.1.w": [64, 64]}
    check_shapes(saved, dict(saved), where="ckpt")
    with pytest.raises(ConfigError) as err:
        check_shapes(saved, {"embed": [40, 32], "layers.0.w": [32, 32]}, where="ckpt/actor")
    message = str(err.value)
    assert "ckpt/actor" in message and "embed saved [40, 64], model [40, 32]" in message
    assert "not in the model: layers.1.w" in message


def test_cadence_rng_and_metrics_truncation(tmp_path):
    assert [s for s in range(1, 11) if should_checkpoint(s, 4, 10)] == [4, 8, 10]
    assert [s for s in range(1, 6) if should_checkpoint(s, 0, 5)] == [5]
    state = rng_state()
    a = (torch.rand(3), random.random())
    set_rng_state(state)
    assert torch.equal(a[0], torch.rand(3)) and a[1] == random.random()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    truncate_metrics(metrics, 4)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3, 4]


def test_peerflow_checkpoints_lists_status(tmp_path, capsys):
    from peerflow.cli import main

    for step in (2, 4):
        _save(tmp_path, step)
    shard = step_dir(tmp_path, 4) / "actor" / "w.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    step_dir(tmp_path, 6).mkdir()
    assert main(["checkpoints", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "status", "size", "path"]
    assert lines[1].split()[:2] == ["2", "verified"] and "--resume continues here" in lines[1]
    assert lines[2].split()[:2] == ["4", "corrupt"] and "actor/w.safetensors has" in lines[2]
    assert lines[3].split()[:2] == ["6", "incomplete"]
    assert main(["checkpoints", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"], r["resume"]) for r in rows] == [
        (2, "verified", True), (4, "corrupt", False), (6, "incomplete", False)]
    assert main(["checkpoints", str(tmp_path / "nothing-here")]) == 1
