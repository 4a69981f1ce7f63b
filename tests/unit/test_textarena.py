"""textarena games through the one agent driver: real games, the hf engine, tokens exact."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents import Turn
from peerflow.agents.rollout import LOSS_MASK, AgentRollout
from peerflow.config import AgentConfig, structure_options
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError
from peerflow.rollout.prompts import encode_prompt
from peerflow.rollout.sampler import Draw

pytest.importorskip("textarena")

from peerflow.contrib.ecosystem.textarena import (  # noqa: E402
    TextArenaEnvironment,
    TextArenaOptions,
    TextArenaTask,
    TextArenaTaskOptions,
)

GAME = "GuessTheNumber-v0"


def _task(env_id: str = GAME, **options) -> TextArenaTask:
    return TextArenaTask(structure_options(TextArenaTaskOptions, {"env_id": env_id, **options},
                                           "task.options"))


def _bisect(env: TextArenaEnvironment) -> tuple[int, float]:
    """Plays the number game by binary search; returns (turns, final reward)."""
    low, high = 1, 20
    for index in range(10):
        guess = (low + high) // 2
        result = env.step(Turn(token_ids=(), text=f"I guess [{guess}]", index=index))
        if result.done:
            return index + 1, env.final_reward()
        low, high = (guess + 1, high) if "higher" in result.observation else (low, guess - 1)
    return 10, env.final_reward()


def test_registered(plugin_manager):
    assert plugin_manager.get("task", "textarena") is TextArenaTask
    assert plugin_manager.get("environment", "textarena") is TextArenaEnvironment


@pytest.mark.parametrize(("env_id", "expected"), [
    ("Hangman-v0", r"downloads data \(word lists\)"),
    ("Wordle-v0", r"downloads data \(word lists\)"),
    ("TicTacToe-v0", "cannot be started as a one-player game"),
    ("GuessTheNumbr-v0", "Did you mean GuessTheNumber-v0"),
])
def test_unplayable_games_are_refused_with_the_reason(env_id, expected):
    with pytest.raises(ConfigError, match=expected):
        _task(env_id)


def test_a_game_is_dealt_by_its_example_and_played_to_its_reward():
    task = _task(train_size=4, eval_size=2)
    example = task.example("train", 1, seed=3)
    assert example == task.example("train", 1, seed=3)
    assert "Guess The Number" in example.prompt
    assert task.example("eval", 0, seed=3) == task.example("eval", 0, seed=8)
    before = random.getstate()
    first, second = (TextArenaEnvironment(example, TextArenaOptions()) for _ in range(2))
    assert first.initial_prompt() == second.initial_prompt() == example.prompt
    assert _bisect(first) == _bisect(second)  # the same secret for the group's episodes
    assert first.final_reward() == 1.0
    assert random.getstate() == before  # the process's own random stream is untouched
    lost = TextArenaEnvironment(example, TextArenaOptions(unfinished_reward=-0.5))
    assert lost.final_reward() == -0.5  # still open: the configured reward
    for index in range(10):
        if lost.step(Turn(token_ids=(), text="[0]", index=index)).done:
            break
    assert lost.game.done and lost.final_reward() <= 0.0


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """The tiny character Llama with room for a game's ~500-character prompt."""
    from tests.engines.hf.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-textarena"))
    config = Path(path) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "max_position_embeddings": 2048}))
    return path


def test_games_run_through_the_agent_driver_token_exactly(long_model):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(EngineContext(model_path=long_model, layout=ParallelLayout(),
                                           seed=1))
    tok = engine.tokenizer
    task = _task(train_size=2)
    draws = [Draw(position=i, example=task.example("train", i, seed=0)) for i in range(2)]
    driver = AgentRollout(env_cls=TextArenaEnvironment, env_options=TextArenaOptions(),
                          settings=AgentConfig(environment="textarena", max_turns=3,
                                               max_total_tokens=400))
    batch = driver(engine, tok, draws, SamplingParams(n=2, temperature=1.0, max_tokens=4,
                                                       seed=2))
    assert len(batch) == 4 and batch.group_id.tolist() == [0, 0, 1, 1]
    for k, (prompt, ids, mask, logprobs) in enumerate(zip(
            batch.ragged("prompt_ids").rows(), batch.ragged("response_ids").rows(),
            batch.ragged(LOSS_MASK).rows(), batch.ragged("rollout_logprobs").rows())):
        assert prompt.tolist() == encode_prompt(tok, draws[k // 2].example.prompt)
        ids, mask = ids.tolist(), mask.tolist()
        # Replay the game with the model's own turns: every observation is the game's
        # answer, tokenised as it is and masked out; model tokens keep their log-probs.
        env = TextArenaEnvironment(draws[k // 2].example, TextArenaOptions())
        at, turn = 0, 0
        while at < len(ids):
            end = at
            while end < len(ids) and mask[end]:
                end += 1
            text = tok.decode(ids[at:end], skip_special_tokens=True)
            assert all(lp < 0 for lp in logprobs[at:end].tolist())
            result = env.step(Turn(token_ids=ids[at:end], text=text, index=turn))
            turn, at = turn + 1, end
            if at < len(ids):
                observed = ids[at:at + len(tok(result.observation,
                                                 add_special_tokens=False)["input_ids"])]
                assert observed == tok(result.observation, add_special_tokens=False)[
                    "input_ids"]
                assert not any(mask[at:at + len(observed)])
                assert logprobs[at:at + len(observed)].abs().sum() == 0
                at += len(observed)
        assert turn == int(batch["num_turns"][k])
        expected = env.final_reward()
        assert float(batch["env_reward"][k]) == expected
    assert set(batch["finish_reason"]) <= {"stop", "max_turns", "max_tokens"}
    assert int(batch["num_turns"].max()) >= 2  # observations were appended (invalid moves)
