"""`peerflow train` with TRL `environment_factory` classes: its own reward, its mistakes.

A class written as TRL's docs write it (`self.reward` and a task reward
`reward_func(environments, **kwargs)`) trains on that reward, and the task's own default
reward is neither computed nor shown. A class whose every group fails to start — a
timestamp in its opening (the `n` episodes diverge at their first prompt) or an opening
longer than the model's context — no longer ends the run: every failure is counted and
kept with its traceback in `RUN_DIR/agent_errors.jsonl`, the step's warning names the
file, and only `rollout.agent.fatal_after_steps` such steps in a row stop the run, naming
the first failure. Tiny random Qwen2 with a tool-calling template, one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.distributed

ENVS = ROOT / "tests" / "helpers" / "trl_envs.py"


def _config(tmp_path: Path, factory: str, **agent) -> str:
    from tests.helpers.chat_model import build_chat_model

    config = {
        "seed": 0, "model": {"path": build_chat_model(tmp_path / "model"), "dtype": "float32"},
        "task": {"name": "tool-arithmetic", "reward": f"{ENVS}:reward_func",
                 "options": {"digits": 2}},
        "algorithm": {"advantage": "grpo", "loss": "ppo_clip", "kl": {"coef": 0.0}},
        "rollout": {"backend": "hf",
                    "sampling": {"n": 4, "temperature": 1.0, "max_tokens": 6},
                    "agent": {"environment": "environment-factory", "max_turns": 2,
                              "max_total_tokens": 64,
                              "options": {"factory": f"{ENVS}:{factory}",
                                          "answer_tool": "submit"}, **agent}},
        "trainer": {"backend": "fsdp", "lr": 1.0e-3},
        "workflow": {"graph": "grpo"},
        "runtime": {"nprocs": 1, "torch_threads": 1},
        "run": {"steps": 2, "prompts_per_step": 4, "trace": False, "tensorboard": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _train(config: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "peerflow", "train", config, "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_a_trl_class_trains_on_its_own_reward(tmp_path, metrics_of):
    run_dir = tmp_path / "run"
    proc = _train(_config(tmp_path, "Guess"), run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics_of(run_dir)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        # the reward is reward_func(environments) of each episode's instance: 1/(1+len)
        assert m["reward/reward_func/mean"] == pytest.approx(m["reward/mean"])
        assert 0.0 < m["reward/mean"] <= 1.0 and m["agent/finish/env_error"] == 0.0
        # the task's default reward (`contains`) is neither computed nor shown
        assert not [k for k in m if k.startswith("reward/contains")]
    assert any(m["reward/std"] > 0 and m["actor/grad_norm"] > 0 for m in rows)
    sample = json.loads((run_dir / "samples" / "step_1.jsonl").read_text().splitlines()[0])
    assert set(sample.get("reward_components", {})) <= {"reward_func"}


def test_agent_mistakes_are_failed_groups_and_only_a_streak_stops_the_run(tmp_path,
                                                                         metrics_of):
    config = _config(tmp_path, "Broken")
    run_dir = tmp_path / "run"
    proc = _train(config, run_dir)  # 2 steps of failed groups, fatal_after_steps 3
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics_of(run_dir)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert m["agent/env_errors"] == m["samples"] == 16
        assert m["agent/finish/env_error"] == 1.0
    assert "agent_errors.jsonl" in proc.stderr  # the step's warning names the file
    errors = [json.loads(line) for line in
              (run_dir / "agent_errors.jsonl").read_text().splitlines()]
    assert len(errors) == 32 and {e["step"] for e in errors} == {1, 2}
    kinds = {e["type"] for e in errors}
    assert kinds == {"DivergentFirstPrompts", "PromptPastContext"}
    assert all(e["message"] and {"sample_id", "group_id", "traceback"} <= set(e)
               for e in errors)

    stopped = _train(config, tmp_path / "stopped", "run.steps=4",
                     "rollout.agent.fatal_after_steps=2")
    assert stopped.returncode != 0
    err = stopped.stderr
    assert "every agent episode failed in the last 2 steps" in err
    assert "The first (step 1" in err and "rollout.agent.fatal_after_steps" in err
    assert len(metrics_of(tmp_path / "stopped")) == 2
