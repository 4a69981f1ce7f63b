"""Errors an operator can act on (issue 18, item 5): each names the file, key or setting
and the fix, before any worker starts where possible; Ctrl-C stops every rank at one step,
checkpoints it and prints the `--resume` command; a second Ctrl-C stops them at once."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerflow.checkpoint import list_checkpoints, newest_complete
from peerflow.distributed.init import free_port
from peerflow.distributed.procs import process_gone

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")

pytestmark = pytest.mark.distributed


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PEERFLOW_FAULT_STORE"):
        if key not in extra:
            env.pop(key, None)
    return env


def peerflow(*argv: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "peerflow", *argv], env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


def test_prompts_per_step_below_the_dp_size_is_a_config_error() -> None:
    """Was `Batch has no field 'response_ids'` from inside the workers."""
    proc = peerflow("config", "validate", QUICKSTART, "--set", "run.prompts_per_step=1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("run.prompts_per_step=1 is smaller than the data-parallel size 2" in proc.stderr)
    assert "set run.prompts_per_step to at least 2" in proc.stderr


def test_model_directory_without_tokenizer_names_the_directory_and_fix(tmp_path) -> None:
    """Was transformers' "install sentencepiece or tiktoken", from inside the workers."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 32}))
    for command in (["config", "validate"], ["train", "--run-dir", str(tmp_path / "run")]):
        proc = peerflow(*command, QUICKSTART, "--set", f"model.path={model}",
                        "--set", "model.builder=null")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"model directory {str(model)!r} has no tokenizer files" in proc.stderr
        assert "save_pretrained" in proc.stderr
        assert "worker(s)" not in proc.stdout  # refused before spawning


def test_config_validate_opens_the_dataset(tmp_path) -> None:
    """An empty dataset fails `config validate` (was: ok, then `StopIteration` in workers)."""
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    proc = peerflow("config", "validate", QUICKSTART, "--set", "task.name=dataset",
                    "--set", f"task.options={{path: {data}}}")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert str(data) in proc.stderr and "ok" not in proc.stdout  # the message is the task's


def test_master_port_in_use_is_one_line_naming_port_and_fix(tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        proc = peerflow("train", QUICKSTART, "--run-dir", str(tmp_path / "run"), env=env)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert f"MASTER_PORT={port}" in lines[0] and "already in use" in lines[0]
    assert "pick a free port" in lines[0]


def _start_train(run: Path, *overrides: str, launcher: str = "elastic") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "peerflow", "train", QUICKSTART, "--run-dir", str(run),
         "--launcher", launcher, "--set", "run.prompts_per_step=4", "--set", "run.trace=false",
         *[a for o in overrides for a in ("--set", o)]],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # its own process group, as a terminal's foreground job


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if line.strip()]


def _wait_until(proc: subprocess.Popen, done, what: str, timeout: float = 240) -> None:
    """Waits (generously: the machine may be loaded) while `proc` runs, until `done()`."""
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.2)


def _wait_for_step(proc: subprocess.Popen, run: Path, step: int) -> None:
    _wait_until(proc, lambda: bool(_steps(run)) and _steps(run)[-1] >= step, f"step {step}")


# sync: Ctrl-C in a terminal (the launcher and every worker get SIGINT); async: SIGINT to
# the launcher alone (as `kill -INT`), which asks the workers through the fault store.
# async is slow-tier: [sync] keeps the stop-checkpoint-resume contract in the default run,
# and tests/distributed/test_async_train.py resumes async runs exactly
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_ctrl_c_checkpoints_the_stop_step_and_resume_continues(tmp_path, mode) -> None:
    run = tmp_path / "run"
    extra = (["runtime.mode=async", "runtime.placement=split", "rollout.layout.dp=1",
              "trainer.layout.dp=1", "runtime.max_staleness=1"] if mode == "async" else [])
    # no scheduled checkpoint before the end: the one at the stop is the graceful stop's
    proc = _start_train(run, "run.steps=500", "runtime.stop_grace=60", *extra)
    _wait_for_step(proc, run, 2)
    sent = time.monotonic()
    if mode == "sync":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    print(f"{mode}: exited {time.monotonic() - sent:.1f} s after SIGINT")
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    stop = int(re.search(r"stopped gracefully after step (\d+) \(Ctrl-C\); checkpoint of "
                         r"step \1 written", err).group(1))
    assert f"continue with:\n  peerflow train --resume {run}" in err
    found = newest_complete(run)
    assert found is not None and found.step == stop, err  # verified, at the stop step
    assert [(c.step, c.status) for c in list_checkpoints(run, check=True)] == [(stop, "verified")]
    assert _steps(run) == list(range(1, stop + 1))  # no step past the agreed one
    for log in run.glob("logs/rank*.log"):  # nobody was stopped at once
        assert "interrupted (SIGINT)" not in log.read_text(), log.read_text()

    resumed = peerflow("train", "--resume", str(run), "--set", f"run.steps={stop + 2}")
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(run) == list(range(1, stop + 3))  # metrics continue from the stop


def _acknowledged(log: Path) -> re.Match | None:
    text = log.read_text() if log.is_file() else ""
    return re.search(r"\(pid (\d+)\): SIGINT, graceful stop requested", text)


def test_a_second_ctrl_c_stops_every_rank_at_once(tmp_path) -> None:
    """Rank 1 is stuck in step 2's reward, so the graceful stop cannot reach a step
    boundary, and rank 0 waits for it inside a gloo collective (`all_reduce`).

    The first Ctrl-C is acknowledged at once on every rank, the blocked one included
    (`WorkerStopHandler`'s watcher thread: Python would run the handler only when the
    collective returns, here never); the second stops every rank at once."""
    run, flag = tmp_path / "run", tmp_path / "stuck"
    env = _env(STUCK_RANK="1", STUCK_CALL="2", STUCK_FLAG=str(flag))  # step 2 never ends
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.stuck_reward", QUICKSTART, str(run),
         "run.steps=50", "run.prompts_per_step=4", "task.reward=stuck", "run.trace=false",
         "runtime.stop_grace=600", "runtime.reward_timeout=600"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    rank0_passed = Path(f"{flag}.rank0")  # rank 0 left its reward for the collective
    _wait_until(proc, lambda: flag.exists() and rank0_passed.exists(), "stuck reward")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    sent = time.monotonic()
    logs = [run / "logs" / "rank0.log", run / "logs" / "rank1.log"]
    _wait_until(proc, lambda: all(_acknowledged(log) for log in logs),
                "'graceful stop requested' in every rank's log")
    time.sleep(max(0.0, sent + 1.5 - time.monotonic()))  # later than the Ctrl-C's echo
    assert proc.poll() is None, proc.communicate()  # waiting for the step boundary
    assert _steps(run) == [1]
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "LAUNCHER: interrupted (Ctrl-C); every worker was stopped at once" in err, err
    assert "Traceback" not in err, err
    assert newest_complete(run) is None  # nothing was saved at the stop
    assert sorted(run.glob("logs/rank*.log")) == logs
    for log in logs:  # every worker is gone
        assert process_gone(int(_acknowledged(log).group(1)))
    assert "interrupted (SIGINT)" in logs[1].read_text()


# SIGTERM in every run; SIGINT takes the same path under torchrun (slow tier).
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                 signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_under_torchrun_checkpoints_the_stop_step(tmp_path, sig) -> None:
    """torchrun's agent forwards Ctrl-C, and SIGTERM (e.g. from Slurm or Kubernetes), to
    its workers: the same graceful stop, within the agent's --shutdown-timeout."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
         "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         "-m", "peerflow", "train", QUICKSTART,
         "--run-dir", str(run), "--set", "run.steps=500", "--set", "run.prompts_per_step=4",
         "--set", "run.trace=false", "--set", "runtime.stop_grace=25"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    _wait_for_step(proc, run, 2)
    os.kill(proc.pid, sig)  # the agent alone; it signals its workers
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode != 0, out
    stop = int(re.search(r"stopped gracefully after step (\d+) \(stop requested\); "
                         r"checkpoint of step \1 written", (run / "logs" / "rank0.log")
                         .read_text()).group(1))
    assert f"continue with:\n  peerflow train --resume {run}" in out, out
    found = newest_complete(run)
    assert found is not None and found.step == stop, out
    assert _steps(run) == list(range(1, stop + 1))
    for rank in (0, 1):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"): {sig.name}, graceful stop requested" in log, log


# Slow tier: the graceful stop is the same under every launcher (torchrun and the local
# one above); test_launch.py places workers with the Ray launcher in every run.
@pytest.mark.slow
def test_ctrl_c_under_the_ray_launcher_checkpoints_the_stop_step(tmp_path) -> None:
    """`--launcher ray`: Ctrl-C in a terminal (the driver's process group) is the same
    graceful stop; the driver waits for its actors to finish the step and save it."""
    pytest.importorskip("ray")
    run = tmp_path / "run"
    proc = _start_train(run, "run.steps=500", "runtime.stop_grace=60", launcher="ray")
    _wait_for_step(proc, run, 2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    stop = int(re.search(r"stopped gracefully after step (\d+) \(Ctrl-C\); checkpoint of "
                         r"step \1 written", err).group(1))
    assert f"continue with:\n  peerflow train --resume {run}" in err
    found = newest_complete(run)
    assert found is not None and found.step == stop, err
    assert _steps(run) == list(range(1, stop + 1))
