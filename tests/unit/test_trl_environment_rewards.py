"""TRL's reward pattern for `environment_factory` classes, read as TRL reads it.

A class with `self.reward` and a task reward `reward_func(environments, **kwargs)` (TRL's
OpenEnv guide and examples), through the real driver on the hf engine: each episode
scores itself on its own instance, the task's unused reward is neither computed nor
shown, and the pattern is refused at validate — naming `get_reward` — where no episode
has such an instance.
"""

from __future__ import annotations

import math

import pytest
import torch

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents.rollout import ENV_REWARD_COMPONENTS, AgentRollout
from peerflow.algorithms.base import Example
from peerflow.batch import Batch
from peerflow.config import AgentConfig, load_config, validate_config
from peerflow.contrib.ecosystem.tool_episodes import EnvironmentFactory, FactoryOptions
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError
from peerflow.rewards.loading import reward_shape
from peerflow.rewards.setup import EpisodeReward
from peerflow.rollout.sampler import Draw
from tests.helpers import trl_envs

ENVS = "tests.helpers.trl_envs"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from tests.helpers.chat_model import build_chat_model

    path = build_chat_model(tmp_path_factory.mktemp("chat"))
    return HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout(), seed=1))


class AttributeOnly:
    """TRL-style: `self.reward` set by a tool, no `get_reward`, no task reward."""

    def reset(self, **kwargs):
        self.reward, self.done = 0.0, False

    def submit(self, answer: str) -> str:
        """Submits the answer.

        Args:
            answer: The answer.
        """
        self.reward, self.done = 0.5, True
        return "ok"


def _run(engine, factory: str, rewards=()):
    driver = AgentRollout(env_cls=EnvironmentFactory,
                          env_options=FactoryOptions(factory=factory, answer_tool="submit"),
                          settings=AgentConfig(environment="environment-factory",
                                               max_turns=2, max_total_tokens=64),
                          rewards=tuple(rewards))
    draws = [Draw(position=i, example=Example(prompt="2+2?", answer="4", index=i))
             for i in range(2)]
    return driver(engine, engine.tokenizer, draws,
                  SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3))


def test_reward_func_of_environments_scores_each_episodes_instance(engine):
    batch = _run(engine, f"{ENVS}:Guess",
                 [EpisodeReward(name="reward_func", function=trl_envs.reward_func)])
    texts = [engine.tokenizer.decode(r.tolist(), skip_special_tokens=True)
             for r in batch.ragged("response_ids").rows()]
    assert batch["finish_reason"] == ["stop"] * 4 and batch["num_turns"].tolist() == [1] * 4
    # Guess.submit sets self.reward = 1 / (1 + len(answer)); reward_func reads it
    for text, reward, named in zip(texts, batch["env_reward"].tolist(),
                                   batch[ENV_REWARD_COMPONENTS]):
        assert reward == pytest.approx(1.0 / (1.0 + len(text.strip())))
        assert named == {"reward_func": pytest.approx(reward)}


def test_the_reward_attribute_is_the_reward_without_get_reward(engine):
    batch = _run(engine, f"{__name__}:AttributeOnly")
    assert batch["env_reward"].tolist() == [0.5] * 4
    assert batch[ENV_REWARD_COMPONENTS] == [{"reward": 0.5}] * 4


def test_the_signatures_read_as_trl_rewards_that_take_environments():
    def with_completions(completions, environments, **kwargs):
        return [e.reward for e in environments]

    for fn in (trl_envs.reward_func, with_completions):
        shape = reward_shape(fn)
        assert shape.trl and shape.environments


def test_reward_func_is_refused_where_no_episode_has_an_instance(plugin_manager):
    reward = f"task.reward={ENVS.replace('.', '/')}.py:reward_func"
    factory = ["rollout.agent.environment=environment-factory",
               f"rollout.agent.options.factory={ENVS}:Guess"]
    validate_config(load_config(None, [reward, *factory]), plugin_manager)  # supported
    for extra in ([], ["rollout.agent.environment=retry"]):
        with pytest.raises(ConfigError, match="get_reward") as info:
            validate_config(load_config(None, [reward, *extra]), plugin_manager)
        assert "environment-factory" in str(info.value)
    mixed = load_config(None, [*factory, f"task.rewards=[{{fn: '{ENVS.replace('.', '/')}.py:"
                                          "reward_func'}, {fn: exact_match}]"])
    with pytest.raises(ConfigError, match="would never run"):
        validate_config(mixed, plugin_manager)


class _Counting:
    """A `RewardSet` stand-in: counts the answers it is asked to score."""

    def __init__(self):
        self.scored = 0

    def score(self, responses, examples, sample_ids=None, *, context=None):
        from peerflow.rewards.scoring import RewardScores

        self.scored += len(responses)
        return RewardScores(total=[0.03] * len(responses), counts={}, failed=[False] *
                            len(responses), components={"exact_match": [0.03] *
                                                        len(responses)},
                            metrics={"reward/exact_match/mean": (0.03, len(responses))})


def _agent_batch(env_rewards):
    n = len(env_rewards)
    batch = Batch(sample_id=torch.arange(n), group_id=torch.zeros(n, dtype=torch.long),
                  weight_version=torch.zeros(n, dtype=torch.long))
    from peerflow.batch import RaggedField

    batch.set("response_ids", RaggedField.from_tensors([torch.tensor([1, 2])] * n,
                                                       dtype=torch.int64))
    batch.set("env_reward", torch.tensor(env_rewards, dtype=torch.float32))
    batch.set_objects(ENV_REWARD_COMPONENTS, [{} if math.isnan(r) else {"get_reward": r}
                                              for r in env_rewards])
    batch.set_objects("example", [Example(prompt="p", answer="a", index=i) for i in range(n)])
    return batch


def test_the_unused_task_reward_is_neither_computed_nor_shown():
    from peerflow.worker.executors import score_texts

    rewards = _Counting()
    scores = score_texts(rewards, _agent_batch([0.0, 1.0]), ["x", "y"])
    assert rewards.scored == 0 and scores.total == [0.0, 1.0]
    assert set(scores.components) == {"get_reward"}
    assert "reward/exact_match/mean" not in scores.metrics
    # where an episode gave no reward, the task's reward scores that episode alone
    scores = score_texts(rewards, _agent_batch([0.0, math.nan]), ["x", "y"])
    assert rewards.scored == 1 and scores.total == [0.0, pytest.approx(0.03)]
    assert scores.components["exact_match"][1] == pytest.approx(0.03)
    assert math.isnan(scores.components["exact_match"][0])
