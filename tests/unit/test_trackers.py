"""Trackers: W&B options from the config (offline), MLflow in a local file store, the checks."""

from __future__ import annotations

import json
import time

import pytest

from peerflow.config import load_config, validate_config
from peerflow.errors import ConfigError
from peerflow.outputs import MetricsWriter, read_metrics

#: Two samples as `peerflow.worker.samples` writes them (one with a `|` and a line break).
SAMPLES = [
    {"step": 1, "sample_id": 0, "group_id": 0, "prompt": "12>", "response": "21|x\ny",
     "reward": 1.0, "components": {"acc": 1.0}, "advantage": 0.5, "finish_reason": "stop",
     "response_tokens": 3},
    {"step": 1, "sample_id": 1, "group_id": 0, "prompt": "12>", "response": "11",
     "reward": 0.0, "components": {"acc": 0.0}, "advantage": -0.5, "finish_reason": "length",
     "response_tokens": 4},
]
WANDB = ["run.wandb=true", "run.tensorboard=false", "run.trackers.wandb.project=rl-tests",
         "run.trackers.wandb.entity=my-team", "run.trackers.wandb.name=grpo-lr1e-6",
         "run.trackers.wandb.tags=[grpo, tiny]", "run.trackers.wandb.group=sweep-3",
         "run.trackers.wandb.mode=offline"]


def test_wandb_gets_project_entity_name_tags_group_from_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for key in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP",
                "WANDB_TAGS", "WANDB_NAME"):
        monkeypatch.delenv(key, raising=False)
    config = load_config(None, WANDB)
    run_dir = tmp_path / "run-1"
    with MetricsWriter(run_dir, config) as writer:
        (tracker,) = writer.trackers
        run = tracker.run
        assert (run.project, run.entity, run.name, run.group) == (
            "rl-tests", "my-team", "grpo-lr1e-6", "sweep-3")
        assert tuple(run.tags) == ("grpo", "tiny") and run.id == "run-1"
        assert run.config["trainer"]["lr"] == config.trainer.lr  # the resolved config
        writer.log_samples(1, SAMPLES, "train")
        writer(1, {"reward/mean": 0.25, "actor/grad_norm": float("nan")})
        writer(2, {"reward/mean": 0.75})
        assert "offline in" in tracker.location and "wandb sync" in tracker.location
    # what it wrote: one offline run under RUN_DIR/wandb holding the options and metrics
    # (wandb's service process may still be writing it when `finish` returns)
    (offline,) = (run_dir / "wandb").glob("offline-run-*-run-1")
    deadline = time.monotonic() + 60
    while b"reward/mean" not in (data := (offline / "run-run-1.wandb").read_bytes()):
        assert time.monotonic() < deadline, data
        time.sleep(0.2)
    for text in (b"rl-tests", b"my-team", b"grpo-lr1e-6", b"sweep-3", b"tiny", b"reward/mean",
                 b"samples/train"):
        assert text in data, text
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    # options left unset come from W&B's environment variables, as TRL users set them
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    with MetricsWriter(tmp_path / "run-2", load_config(None, WANDB[:2] + WANDB[-1:])) as writer:
        run = writer.trackers[0].run
        assert (run.project, run.name, run.group) == ("from-env", "run-2", "")


def test_mlflow_run_in_a_local_file_store_and_resumed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load_config(None, ["run.mlflow=true", "run.tensorboard=false",
                                "run.trackers.mlflow.experiment=rl", "trainer.lr=3e-6",
                                "run.trackers.mlflow.tags={team: post-training}"])
    run_dir = tmp_path / "run"
    with MetricsWriter(run_dir, config) as writer:
        writer.log_samples(1, SAMPLES, "train")
        writer(1, {"reward/mean": 0.25, "pass@2": 0.5, "time/route_a->b@train": 0.1})
    # a resumed run (the same run directory) continues the same MLflow run
    with MetricsWriter(run_dir, config) as writer:
        writer(2, {"reward/mean": 0.75})
        location = writer.trackers[0].location
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("rl").experiment_id])
    assert location.endswith(run.info.run_id) and run.info.status == "FINISHED"
    assert run.info.run_name == "run" and run.data.tags["team"] == "post-training"
    assert run.data.params["trainer.lr"] == "3e-06"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert client.get_metric_history(run.info.run_id, "time/route_a-_b_train")[0].value == 0.1
    (artifact,) = client.list_artifacts(run.info.run_id, "samples")
    assert artifact.path == "samples/train_step_1.jsonl"
    saved = json.loads((run_dir / "mlflow_run.json").read_text())
    assert saved["run_id"] == run.info.run_id


def test_options_for_a_tracker_that_is_off_are_said_when_the_run_starts(tmp_path, capsys):
    from peerflow.plugins import load_plugins

    config = load_config(None, ["run.trackers.wandb.project=rl", "run.trackers.mlflow.tags={a: b}",
                                "run.tensorboard=false"])
    validate_config(config, load_plugins())  # not an error: a resume may switch one off
    with MetricsWriter(tmp_path, config) as writer:
        assert writer.trackers == []
    err = capsys.readouterr().err
    assert "run.trackers.wandb sets project, but run.wandb is false: nothing goes there" in err
    assert "run.trackers.mlflow sets tags, but run.mlflow is false" in err
    with pytest.raises(ConfigError, match=r"run.trackers.wandb.mode: 'offlin' is not one of"):
        load_config(None, ["run.trackers.wandb.mode=offlin"])


def test_tensorboard_gets_the_samples_as_a_text_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path) as writer:
        writer.log_samples(1, SAMPLES, "train")
        writer.log_samples(1, [], "eval")  # nothing to show: nothing written
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    assert acc.Tags()["tensors"] == ["samples/train/text_summary"]
    (event,) = acc.Tensors("samples/train/text_summary")
    table = event.tensor_proto.string_val[0].decode().splitlines()
    assert table[0] == ("step | sample_id | group_id | reward | advantage | finish_reason | "
                        "response_tokens | prompt | response | components")
    assert table[2].startswith("1 | 0 | 0 | 1.0 | 0.5 | stop | 3 | 12> | 21\\|x<br>y | ")
    assert event.step == 1 and len(table) == 4


def test_a_failing_tracker_is_dropped_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    import shutil

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load_config(None, ["run.mlflow=true", "run.tensorboard=false"])
    with MetricsWriter(tmp_path, config) as writer:
        writer(1, {"reward/mean": 0.25})
        shutil.rmtree(tmp_path / "mlruns")  # the tracking store goes away mid-run
        writer(2, {"reward/mean": 0.5})
        writer.log_samples(2, SAMPLES, "train")
        assert writer.trackers == []
    err = capsys.readouterr().err
    assert "the mlflow tracker failed (" in err and "mlruns' does not exist" in err
    assert "metrics.jsonl keeps every step" in err
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [0.25, 0.5]
