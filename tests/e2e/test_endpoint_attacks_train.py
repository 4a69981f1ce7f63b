"""`peerflow train` with an agent program that attacks the policy endpoint first.

Every episode sends the calls that used to end a run (a negative and an out-of-vocabulary
token id, `seed: 10**30`, a prompt past the context) and one that multiplied the batch
(`n: 3000`), then a valid call. The run trains its steps, every episode ends `stop`, and
each step's samples are the run's own `prompts x n`.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import ROOT

pytest.importorskip("openai")

AGENT = '''
import httpx

ATTACKS = [
    ("generate", {"token_ids": [-1]}, "token_ids.0"),
    ("generate", {"token_ids": [3, 10**6]}, "token_ids.1"),
    ("generate", {"token_ids": [3], "sampling_params": {"seed": 10**30}},
     "sampling_params.seed"),
    ("generate", {"token_ids": [5] * 5000}, "token_ids"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 3000}, "n"),
]


def run_episode(base_url, api_key, model, example):
    root = base_url.removesuffix("/v1")
    paths = {"chat": f"{base_url}/chat/completions",
             "generate": f"{root}/inference/v1/generate"}
    held = 0
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {api_key}"}) as client:
        for route, body, param in ATTACKS:
            answer = client.post(paths[route], json=body)
            held += answer.status_code == 400 and answer.json()["error"]["param"] == param
        good = client.post(paths["chat"], json={"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": example["prompt"]}]})
        good.raise_for_status()
    return float(held == len(ATTACKS))
'''


@pytest.mark.slow
def test_a_run_survives_an_agent_that_attacks_its_endpoint(tmp_path, metrics_of,
                                                          peerflow_train):
    """The default test keeping this contract: tests/unit/test_endpoint_edge.py
    (test_each_malformed_call_gets_400_naming_its_field_and_the_run_goes_on)."""
    from tests.helpers.chat_model import build_chat_model

    agent = tmp_path / "hostile_agent.py"
    agent.write_text(AGENT)
    model = build_chat_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    peerflow_train([str(ROOT / "examples" / "openai_agent.yaml"), "--run-dir", str(run_dir)], [
        f"model.path={model}", "run.steps=2", "run.prompts_per_step=2",
        "rollout.sampling.n=4", "rollout.sampling.max_tokens=8", "run.trace=false",
        "run.tensorboard=false", f"rollout.agent.options.function={agent}:run_episode"])
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["agent/finish/stop"] == 1.0 and m["agent/finish/env_error"] == 0.0
    rows = [json.loads(line) for line in (run_dir / "samples" / "step_2.jsonl").open()]
    assert len(rows) == 8  # 2 prompts x n=4: the n=3000 call added nothing
    assert all(row["reward"] == 1.0 for row in rows)  # every attack was refused by name
