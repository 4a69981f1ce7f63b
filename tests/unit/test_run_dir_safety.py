"""A run directory is never corrupted: one run at a time, and resumes that keep the model.

Every refusal here happens in `peerflow train` before a worker starts, and leaves the
directory as it was.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from peerflow.checkpoint.fingerprint import check_resume, fingerprint
from peerflow.cli import main
from peerflow.config import load_config
from peerflow.errors import ConfigError
from peerflow.outputs import RunLock, write_resolved_config
from tests.helpers.configs import QUICKSTART, started_run_dir


@pytest.fixture
def run_dir(tmp_path):
    return started_run_dir(tmp_path)


def test_resume_with_a_smaller_model_is_refused_naming_each_key(run_dir, capsys):
    config_before = (run_dir / "config.yaml").read_bytes()
    code = main(["train", "--resume", str(run_dir), "--set", "run.steps=200",
                 "--set", "model.builder_options.hidden_size=64",
                 "--set", "model.builder_options.num_layers=1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "model.builder_options.hidden_size: run has 128, resume has 64" in err
    assert "model.builder_options.num_layers: run has 2, resume has 1" in err
    assert "run.steps" not in err  # may change freely
    assert (run_dir / "config.yaml").read_bytes() == config_before
    assert not (run_dir / "run.lock").exists()




def test_allow_change_releases_a_key_but_never_the_architecture(run_dir):
    changed = load_config(QUICKSTART, ["algorithm.kl.coef=0.1", "trainer.lr=0.01"])
    with pytest.raises(ConfigError, match=r"algorithm\.kl\.coef: run has 0\.0, resume has 0\.1"):
        check_resume(run_dir, changed)
    check_resume(run_dir, changed, ["algorithm.kl"])  # lr is not fingerprinted
    with pytest.raises(ConfigError, match="architecture, dtype and tokenizer cannot change"):
        check_resume(run_dir, load_config(QUICKSTART, ["model.dtype=bfloat16"]), ["model.dtype"])


def test_a_model_directory_is_fingerprinted_by_architecture_and_tokenizer(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                   "num_hidden_layers": 2}))
    (model / "tokenizer.json").write_text("{}")
    config = load_config(QUICKSTART, [f"model.path={model}", "model.builder=null"])
    before = fingerprint(config)
    assert before["model.architecture.hidden_size"] == 64 and "tokenizer.sha256" in before
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                                   "num_hidden_layers": 2}))
    (model / "tokenizer.json").write_text('{"v": 2}')
    after = fingerprint(config)
    assert {k for k in before if before[k] != after[k]} == {
        "model.architecture.hidden_size", "tokenizer.sha256"}


def test_a_second_run_on_a_held_directory_is_refused_before_writing(tmp_path, capsys):
    with RunLock(tmp_path):
        code = main(["train", QUICKSTART, "--run-dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert (tmp_path / "run.lock").is_file()
    assert code == 1
    assert f"pid {__import__('os').getpid()} on host {socket.gethostname()}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no config.yaml, lock released


def test_a_stale_lock_is_taken_over_and_a_used_directory_refused(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "run.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": gone.pid, "started": "earlier"}))
    lines = []
    with RunLock(tmp_path, log=lines.append) as lock:
        assert json.loads(lock.path.read_text())["pid"] != gone.pid
    assert "stale lock" in lines[0] and str(gone.pid) in lines[0]
    write_resolved_config(tmp_path, load_config(QUICKSTART))
    assert main(["train", QUICKSTART, "--run-dir", str(tmp_path)]) == 1
    assert f"--resume {tmp_path}" in capsys.readouterr().err
    (tmp_path / "run.lock").write_text(json.dumps(
        {"host": "elsewhere", "pid": gone.pid, "started": "earlier"}))
    with pytest.raises(ConfigError, match=f"in use by pid {gone.pid} on host elsewhere"):
        RunLock(tmp_path).acquire()


def test_a_lock_of_the_same_torchrun_job_is_taken_over(tmp_path, monkeypatch):
    """torchrun --max-restarts restarts every worker; rank 0 may land on another host."""
    (tmp_path / "run.lock").write_text(json.dumps(
        {"host": "elsewhere", "pid": 1, "started": "earlier", "job": "job-a"}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")  # another job: refused
    with pytest.raises(ConfigError, match="in use by pid 1 on host elsewhere"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    lines = []
    with RunLock(tmp_path, log=lines.append) as lock:
        assert json.loads(lock.path.read_text())["job"] == "job-a"
    assert "torchrun job job-a restarted its workers" in lines[0]


@pytest.mark.parametrize("job", ["none", ""])
def test_torchruns_default_id_identifies_no_job(tmp_path, monkeypatch, job):
    """`none` (torchrun without --rdzv-id) or no id: the lock of another such run is kept
    and the run refused, and this run's lock records no job."""
    from peerflow.outputs.rundir import torchrun_job

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    assert torchrun_job() == ""
    (tmp_path / "run.lock").write_text(json.dumps(
        {"host": "elsewhere", "pid": 1, "started": "earlier", "job": job}))
    with pytest.raises(ConfigError, match="in use by pid 1 on host elsewhere"):
        RunLock(tmp_path).acquire()
    (tmp_path / "run.lock").unlink()
    with RunLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["job"] is None


def test_a_torchrun_restart_before_the_first_checkpoint_starts_again(run_dir, monkeypatch,
                                                                    capsys):
    """The job that started the directory may start it again (no checkpoint to resume
    from); another job, torchrun's default id `none`, or a changed config is refused."""
    from peerflow.cli.train_cmd import check_run_dir
    from peerflow.outputs.rundir import record_torchrun_job, same_torchrun_job

    config = load_config(QUICKSTART)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    assert not same_torchrun_job(run_dir)  # nothing recorded yet
    record_torchrun_job(run_dir)
    assert same_torchrun_job(run_dir)
    check_run_dir(run_dir, config, resume=False, allow_change=[], restarted=True)
    assert f"starting {run_dir} again from step 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="hidden_size: run has 128, resume has 64"):
        check_run_dir(run_dir, load_config(QUICKSTART, ["model.builder_options.hidden_size=64"]),
                      resume=False, allow_change=[], restarted=True)
    for other in ("job-b", "none"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", other)
        assert not same_torchrun_job(run_dir)
    with pytest.raises(ConfigError, match="holds a run that stopped before its first"):
        check_run_dir(run_dir, config, resume=False, allow_change=[], restarted=False)
