"""An OpenEnv environment defined in the tests, served by the run, trained end to end.

`peerflow train` serves `tests.helpers.openenv_envs:ShapedMultiplyEnv` (MCP tools: a
`multiply` tool and a `submit` tool that takes the model's answers) on 127.0.0.1 in each
rollout process, with `max_concurrent_envs` sessions, and trains on its episodes in sync
and async mode (hf engine, tiny random chat model, CPU). The random model writes no tool
calls, so each of its turns is an answer through the `submit` tool, which answers "wrong,
N tries left" until the game ends after three tries: every episode is multi-turn, each
turn a tool call in the served environment.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openenv")
pytest.importorskip("fastmcp")

CONFIG = """
seed: 0
model: {dtype: float32}
task: {name: arithmetic, options: {digits: 1}}
algorithm: {advantage: grpo, loss: ppo_clip, kl: {coef: 0.0}}
rollout:
  backend: hf
  sampling: {n: 4, temperature: 1.0, max_tokens: 6}
  agent:
    environment: openenv
    options:
      server: tests.helpers.openenv_envs:ShapedMultiplyEnv
      max_concurrent_envs: 16
      answer_tool: submit
    max_turns: 5
    max_total_tokens: 1200
trainer: {backend: fsdp, lr: 1.0e-5, grad_clip: 1.0}
workflow: {graph: grpo}
runtime: {nprocs: 1, torch_threads: 1}
run: {steps: 2, prompts_per_step: 2, trace: false, tensorboard: false}
"""
ASYNC = ["runtime.mode=async", "runtime.placement=split", "runtime.max_staleness=1"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.distributed)])
def test_a_served_openenv_environment_trains(tmp_path, metrics_of, peerflow_train, mode):
    from tests.helpers.chat_model import build_chat_model

    model = build_chat_model(tmp_path / "model")
    config = tmp_path / "openenv.yaml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    nprocs = ["--nprocs", "2"] if mode == "async" else []
    peerflow_train([str(config), "--run-dir", str(run_dir), *nprocs],
                   [*(ASYNC if mode == "async" else []), f"model.path={model}"])
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["agent/finish/env_error"] == 0.0 and m["agent/finish/env_timeout"] == 0.0
        assert m["agent/turns_max"] >= 2.0  # the game answered each try
        assert m["agent/observation_tokens"] > 0
        if mode == "sync":  # async runs log no per-component reward means (any reward)
            assert "reward/openenv/mean" in m
    assert max(m["actor/grad_norm"] for m in lines) > 0.0
    rows = [json.loads(line) for line in (run_dir / "samples" / "step_2.jsonl").open()]
    assert len(rows) == 8
    # the environment's rewards are a reward component of every sample, and the outcome
    assert all(row["reward"] == pytest.approx(row["components"]["openenv"]) for row in rows)
    assert all("wrong, 2 tries left" in row["response"] for row in rows)
