"""verifiers v0 environments through the policy endpoint (verifiers 0.3.x, in process).

A `SingleTurnEnv` with a `Rubric` defined here runs its own `rollout` with an `AsyncOpenAI`
client against the endpoint (real HTTP on loopback, the hf engine on a tiny chat model);
the rubric's weighted scores come back as the samples' reward components and its raw
scores as metrics, equal to the rubric's functions applied to the tokens the trainer has.
"""

from __future__ import annotations

import pytest

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents.rollout import ENV_REWARD_COMPONENTS, LOSS_MASK, AgentRollout
from peerflow.config import AgentConfig, structure_options
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError
from peerflow.rollout.sampler import Draw

pytest.importorskip("verifiers")
pytest.importorskip("openai")

from peerflow.contrib.ecosystem.verifiers import (  # noqa: E402
    VerifiersEnvironment,
    VerifiersOptions,
    VerifiersTask,
    VerifiersTaskOptions,
)

ENV = "tests.unit.test_verifiers:load_environment"
QUESTIONS = [("2+2=", "4"), ("3+4=", "7")]


def has_digit(completion, **kwargs) -> float:
    return float(any(ch.isdigit() for ch in completion[-1]["content"]))


def short(completion, **kwargs) -> float:
    return float(len(completion[-1]["content"]) <= 12)


def chars(completion, **kwargs) -> float:
    return float(len(completion[-1]["content"]))


def load_environment(system_prompt: str = "Answer with a number."):
    """A verifiers v0 environment: one turn, a rubric of two rewards and a metric."""
    import verifiers as vf
    from datasets import Dataset

    rows = [{"question": q, "answer": a} for q, a in QUESTIONS]
    rubric = vf.Rubric(funcs=[has_digit, short, chars], weights=[1.0, 0.5, 0.0])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt=system_prompt,
                            rubric=rubric)


def load_multi_turn(**kwargs):
    """A `MultiTurnEnv` that asks once more after each answer, for two turns."""
    import verifiers as vf
    from datasets import Dataset

    class OnceMore(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Once more."}]

    rows = [{"question": q, "answer": a} for q, a in QUESTIONS]
    return OnceMore(dataset=Dataset.from_list(rows), max_turns=2,
                    rubric=vf.Rubric(funcs=[has_digit], weights=[1.0]))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from tests.helpers.chat_model import build_chat_model

    path = build_chat_model(tmp_path_factory.mktemp("chat"))
    return HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout(), seed=4))


def _rollout(engine, draws, *, max_turns: int, max_tokens: int, seed: int):
    """The agent driver's batch of `draws` in a verifiers environment (2 samples each, T 1)."""
    driver = AgentRollout(env_cls=VerifiersEnvironment, env_options=VerifiersOptions(wait_s=60),
                          settings=AgentConfig(environment="verifiers", max_turns=max_turns,
                                               max_total_tokens=400))
    return driver(engine, engine.tokenizer, draws,
                  SamplingParams(n=2, temperature=1.0, max_tokens=max_tokens, seed=seed))


def test_a_single_turn_env_and_its_rubric_run_against_the_endpoint(engine):
    task = VerifiersTask(VerifiersTaskOptions(environment=ENV))
    assert task.size("train") == task.size("eval") == 2  # no eval rows: the train rows
    draws = [Draw(position=i, example=task.example("train", i, seed=0)) for i in range(2)]
    assert draws[0].example.prompt == [{"role": "system", "content": "Answer with a number."},
                                       {"role": "user", "content": "2+2="}]
    batch = _rollout(engine, draws, max_turns=2, max_tokens=8, seed=5)
    tok = engine.tokenizer
    assert list(batch["finish_reason"]) == ["stop"] * 4 and batch["num_turns"].tolist() == [1] * 4
    for k, (prompt, ids, mask) in enumerate(zip(batch.ragged("prompt_ids").rows(),
                                                batch.ragged("response_ids").rows(),
                                                batch.ragged(LOSS_MASK).rows())):
        from peerflow.rollout.prompts import encode_prompt

        assert prompt.tolist() == encode_prompt(tok, draws[k // 2].example.prompt)
        assert mask.all()  # one model turn, nothing re-tokenised
        text = tok.decode(ids.tolist(), skip_special_tokens=True)
        completion = [{"role": "assistant", "content": text}]
        expected = {"has_digit": has_digit(completion), "short": 0.5 * short(completion)}
        assert batch[ENV_REWARD_COMPONENTS][k] == expected
        assert float(batch["env_reward"][k]) == sum(expected.values())
        info = batch["agent_info"][k]
        assert info["verifiers/chars"] == chars(completion)
        assert info["verifiers/short"] == short(completion)


def test_a_multi_turn_env_s_messages_are_observations_of_one_trajectory(engine):
    task = VerifiersTask(VerifiersTaskOptions(
        environment="tests.unit.test_verifiers:load_multi_turn"))
    draws = [Draw(position=0, example=task.example("train", 0, seed=0))]
    batch = _rollout(engine, draws, max_turns=4, max_tokens=6, seed=6)
    tok = engine.tokenizer
    assert batch["num_turns"].tolist() == [2, 2]  # the environment's max_turns
    assert list(batch["finish_reason"]) == ["stop", "stop"]  # one sample: no prefix break
    for k, (ids, mask) in enumerate(zip(batch.ragged("response_ids").rows(),
                                        batch.ragged(LOSS_MASK).rows())):
        ids, mask = ids.tolist(), mask.tolist()
        observed = [i for i, m in zip(ids, mask) if not m]
        assert "Once more." in tok.decode(observed)  # env_response, masked out
        start = max(j for j in range(len(mask)) if not mask[j]) + 1  # the last turn
        last = tok.decode(ids[start:], skip_special_tokens=True)
        assert batch[ENV_REWARD_COMPONENTS][k] == {
            "has_digit": has_digit([{"role": "assistant", "content": last}])}


def test_task_options_are_checked():
    with pytest.raises(ConfigError, match="no installed module 'no_such_env'"):
        structure_options(VerifiersTaskOptions, {"environment": "no-such-env"}, "task.options")
