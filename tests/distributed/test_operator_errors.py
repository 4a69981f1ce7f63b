"""Errors an operator can act on (issue 18, item 5): each names the file, key or setting
and the fix, before any worker starts where possible; Ctrl-C stops every rank and prints
the `--resume` command."""

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

from peerflow.checkpoint import newest_complete

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


def test_ctrl_c_stops_every_rank_and_prints_the_resume_command(tmp_path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "peerflow", "train", QUICKSTART, "--run-dir", str(run),
         "--set", "run.steps=500", "--set", "run.checkpoint_every=1",
         "--set", "run.prompts_per_step=4", "--set", "run.trace=false"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    deadline = time.monotonic() + 240
    while newest_complete(run) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert f"continue with:\n  peerflow train --resume {run}" in err
    logs = sorted(run.glob("logs/rank*.log"))
    assert [log.name for log in logs] == ["rank0.log", "rank1.log"]
    for log in logs:  # every worker recorded the interrupt and is gone
        found = re.search(r"\(pid (\d+)\) interrupted \(SIGINT\)", log.read_text())
        assert found, log.read_text()
        assert _gone(int(found.group(1)))


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
