"""`examples/openai_agent.yaml` under `peerflow train`: an `openai`-client agent program,
served by the policy endpoint, trained end to end on CPU (hf engine, tiny chat model)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import ROOT

pytest.importorskip("openai")

EXAMPLE = ROOT / "examples" / "openai_agent.yaml"


ASYNC = ["runtime.mode=async", "runtime.placement=split", "runtime.max_staleness=1"]


# async is slow-tier: [sync] keeps the example's contract, and tests/e2e/test_agents.py
# runs agent episodes under async's staleness bound in the default run
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=[pytest.mark.distributed,
                                                                       pytest.mark.slow])])
def test_openai_agent_example_trains(tmp_path, metrics_of, peerflow_train, mode):
    from tests.helpers.chat_model import build_chat_model

    model = build_chat_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    nprocs = ["--nprocs", "2"] if mode == "async" else []
    peerflow_train([str(EXAMPLE), "--run-dir", str(run_dir), *nprocs], [
        *(ASYNC if mode == "async" else []),
        f"model.path={model}", "run.steps=2", "run.prompts_per_step=2",
        "rollout.sampling.n=4", "rollout.sampling.max_tokens=8", "run.trace=false",
        "run.tensorboard=false",
        f"rollout.agent.options.function={ROOT / 'examples' / 'openai_agent.py'}:run_episode"])
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["agent/finish/env_error"] == 0.0 and m["agent/finish/env_timeout"] == 0.0
        assert 1.0 <= m["agent/turns_mean"] <= m["agent/turns_max"] <= 3.0
        assert m.get("agent/prefix_breaks", 0.0) == 0.0  # every call extended the last
    # The program's retry prompts came back as observations, and a step trained on them.
    assert max(m["agent/turns_max"] for m in lines) >= 2.0
    assert max(m["agent/observation_tokens"] for m in lines) > 0
    assert max(m["actor/grad_norm"] for m in lines) > 0.0
    # The samples hold the engine's own turns (the trainer's tokens), one row a trajectory.
    rows = [json.loads(line) for line in (run_dir / "samples" / "step_2.jsonl").open()]
    assert len(rows) == 8
    if mode == "async":  # a trajectory spans at most max_staleness + 1 weight versions
        assert all(1.0 <= m["agent/versions_max"] <= 2.0 for m in lines)
