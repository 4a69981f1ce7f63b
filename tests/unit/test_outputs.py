"""Run directory, metrics writer, trace and progress."""

from __future__ import annotations

import datetime as dt
import json
import math

import pytest
import torch

from peerflow.config import RunConfig, load_config
from peerflow.outputs import (
    MetricsWriter,
    StepProgress,
    Tracer,
    create_run_dir,
    read_metrics,
    set_tracer,
    span,
    write_resolved_config,
)
from tests.helpers.configs import hide_modules


def test_fresh_run_dirs_are_timestamped_and_distinct(tmp_path):
    now = dt.datetime(2026, 1, 2, 3, 4, 5)
    a = create_run_dir(root=tmp_path, now=now)
    b = create_run_dir(root=tmp_path, now=now)
    assert a.name == "run-20260102-030405" and b.name == "run-20260102-030405-1"
    given = create_run_dir(tmp_path / "mine")
    assert given.is_dir() and create_run_dir(given) == given


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["trainer.lr=0.01", "run.steps=7"])
    path = write_resolved_config(tmp_path, config)
    again = load_config(path)
    assert isinstance(again, RunConfig) and again.trainer.lr == 0.01 and again.run.steps == 7


def test_metrics_jsonl_and_tensorboard(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        writer(1, {"reward/mean": torch.tensor(0.25), "time/step": 1.5, "bad": math.nan})
        writer.write(2, {"reward/mean": 0.5, "count": 3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert list(first)[0] == "step" and first == {"step": 1, "bad": None, "reward/mean": 0.25,
                                                  "time/step": 1.5}
    assert read_metrics(tmp_path)[1] == {"step": 2, "count": 3, "reward/mean": 0.5}
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.25, 0.5]
    # appending continues the same file (resume)
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer(3, {"reward/mean": 0.75})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_read_metrics_errors_name_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"reward": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: .*'step'"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="PeerFlow run directory"):
        read_metrics(tmp_path / "nope")


def test_a_tracker_without_its_package_is_refused_naming_the_install(tmp_path, monkeypatch):
    from peerflow.config import validate_config
    from peerflow.errors import ConfigError
    from peerflow.plugins import load_plugins

    hide_modules(monkeypatch, "wandb", "mlflow")
    for name in ("wandb", "mlflow"):
        with pytest.raises(ConfigError, match=rf"pip install 'peerflow\[{name}\]'"):
            MetricsWriter(tmp_path, tensorboard=False, **{name: True})
    config = load_config(None, ["run.wandb=true", "run.mlflow=true"])
    with pytest.raises(ConfigError) as info:  # before any worker starts, both at once
        validate_config(config, load_plugins())
    assert "the wandb package is not installed" in str(info.value)
    assert "the mlflow package is not installed" in str(info.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_trace_spans_write_chrome_json(tmp_path):
    tracer = Tracer(tmp_path, rank=1)
    with tracer.span("generate", step=3, prompts=torch.tensor(4)):
        with tracer.span("inner"):
            pass
    tracer.counter("queue", depth=2)
    set_tracer(tracer)
    try:
        with span("global", k="v"):
            pass
    finally:
        set_tracer(None)
    with span("ignored"):  # no default tracer: nothing recorded
        pass
    path = tracer.flush()
    assert path.name == "trace_rank1.json"
    data = json.loads(path.read_text())
    spans = {e["name"]: e for e in data["traceEvents"] if e["ph"] == "X"}
    assert set(spans) == {"generate", "inner", "global"}
    outer, inner = spans["generate"], spans["inner"]
    cpu_ms = outer["args"].pop("cpu_ms")  # the span's thread CPU time: wall minus waiting
    assert outer["pid"] == 1 and outer["args"] == {"step": 3, "prompts": 4}
    assert 0 <= cpu_ms
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert any(e["ph"] == "M" and e["args"] == {"name": "rank 1"} for e in data["traceEvents"])
    off = Tracer(tmp_path, rank=2, enabled=False)
    with off.span("x"):
        pass
    assert off.flush() is None and not (tmp_path / "trace_rank2.json").exists()


def test_progress_prints_lines_off_terminal(capsys):
    with StepProgress(3, live=False) as bar:
        bar.update(1, {"reward/mean": 0.5, "time/step": 0.25, "other": 1})
        with bar.generation(8) as advance:
            advance(8)
    err = capsys.readouterr().err
    assert "step 1/3  reward 0.5  0.25s" in err
    with StepProgress(3, enabled=False) as quiet:
        quiet.update(1, {"reward/mean": 0.5})
    assert capsys.readouterr().err == ""
    with StepProgress(2, live=True) as live:  # rich bar renders without error
        with live.generation(4) as advance:
            advance(2)
        live.update(2, {"reward/mean": 1.0})
