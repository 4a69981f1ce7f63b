"""`task.name: reasoning-gym`: prompts from the library, scored by its own `score_answer`."""

from __future__ import annotations

import pytest

from peerflow.config import load_config, structure_options
from peerflow.errors import ConfigError

rg = pytest.importorskip("reasoning_gym")

from peerflow.contrib.ecosystem.reasoning_gym import (  # noqa: E402
    ReasoningGymOptions,
    ReasoningGymTask,
    reasoning_gym_reward,
)
from peerflow.rewards import build_reward_set  # noqa: E402


def _task(**options) -> ReasoningGymTask:
    return ReasoningGymTask(structure_options(ReasoningGymOptions, options, "task.options"))


def test_registered_task_and_reward(plugin_manager):
    assert plugin_manager.get("task", "reasoning-gym") is ReasoningGymTask
    assert plugin_manager.get("reward", "reasoning_gym").function.endswith(
        ":reasoning_gym_reward")


def test_options_are_checked():
    with pytest.raises(ConfigError, match="exactly one"):
        structure_options(ReasoningGymOptions, {}, "task.options")
    with pytest.raises(ConfigError, match="Did you mean leg_counting"):
        structure_options(ReasoningGymOptions, {"dataset": "leg_countin"}, "task.options")
    with pytest.raises(ConfigError, match="leg_counting has no option min_legs; its options: "
                       "min_animals"):
        structure_options(ReasoningGymOptions, {"dataset": "leg_counting",
                                                "config": {"min_legs": 2}}, "task.options")
    with pytest.raises(ConfigError, match="chain_sum refuses config"):
        structure_options(ReasoningGymOptions, {"datasets": [
            {"name": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}]}, "task.options")
    with pytest.raises(ConfigError, match="answer_format"):
        structure_options(ReasoningGymOptions, {"dataset": "chain_sum", "answer_format": "x"},
                          "task.options")


def test_items_are_the_librarys_own():
    task = _task(dataset="chain_sum", config={"min_terms": 2, "max_terms": 3},
                 train_size=8, eval_size=4, system_prompt="direct")
    library = rg.create_dataset("chain_sum", size=8, seed=7, min_terms=2, max_terms=3)
    for i in range(8):
        example = task.example("train", i, seed=7)
        assert example.answer == library[i]["answer"]
        system, user = example.prompt
        assert user == {"role": "user", "content": library[i]["question"]}
        assert "<answer>" in system["content"]
    assert [e.answer for e in task.examples("train", 7)] == [library[i]["answer"]
                                                            for i in range(8)]
    # The eval split has its own seed, whatever the run's seed is.
    evals = [task.example("eval", i, seed=7).prompt for i in range(4)]
    assert evals == [task.example("eval", i, seed=99).prompt for i in range(4)]
    assert evals != [task.example("train", i, seed=7).prompt for i in range(4)]
    with pytest.raises(IndexError, match="out of range"):
        task.example("train", 8, seed=7)


def test_reward_is_the_datasets_score_answer():
    task = _task(dataset="leg_counting", train_size=4, system_prompt="")
    example = task.example("train", 0, seed=3)
    assert isinstance(example.prompt, str)
    record = {**example.metadata, "answer": example.answer, "prompt": example.prompt,
              "index": 0}
    right, wrong = example.answer, str(int(example.answer) + 1)
    assert reasoning_gym_reward(f"thinking… <answer>{right}</answer>", record) == 1.0
    assert reasoning_gym_reward(f"<answer>{wrong}</answer>", record) == 0.0
    assert reasoning_gym_reward(right, record) == 0.0  # no tags: no answer
    raw = _task(dataset="leg_counting", train_size=4, answer_format="raw").example(
        "train", 0, seed=3)
    assert reasoning_gym_reward(f" {right}\n", {**raw.metadata, "answer": raw.answer}) == 1.0
    # A family with partial credit scores exactly as the library does.
    word = _task(dataset="word_sorting", train_size=2).example("train", 0, seed=1)
    library = rg.create_dataset("word_sorting", size=2, seed=1)
    guess = ", ".join(reversed(library[0]["answer"].split(", ")))
    assert reasoning_gym_reward(f"<answer>{guess}</answer>",
                                {**word.metadata, "answer": word.answer}) == \
        library.score_answer(guess, library[0])
    with pytest.raises(ValueError, match="task.name: reasoning-gym"):
        reasoning_gym_reward("1", {"answer": "1"})


def test_composite_routes_each_item_to_its_family(plugin_manager):
    task = _task(datasets=[{"name": "leg_counting", "weight": 1.0},
                           {"name": "chain_sum", "weight": 1.0, "config": {"max_terms": 2}}],
                 train_size=12)
    examples = list(task.examples("train", 5))
    families = {e.metadata["reasoning_gym"]["metadata"]["source_dataset"] for e in examples}
    assert families == {"leg_counting", "chain_sum"}
    # Scored through the run's reward set, in the reward pool's processes.
    config = load_config(None, ["task.name=reasoning-gym", "task.reward_limits.workers=1"])
    rewards = build_reward_set(config.task, plugin_manager, "reasoning_gym")
    try:
        responses = [f"<answer>{e.answer}</answer>" if i % 2 else "<answer>?</answer>"
                     for i, e in enumerate(examples)]
        scores = rewards.score(responses, examples)
    finally:
        rewards.pool.close()
    assert scores.total == [float(i % 2) for i in range(len(examples))]
    assert scores.counts["reward/errors"] == 0


def test_the_tiny_model_builder_covers_the_questions(tmp_path):
    from transformers import AutoTokenizer

    assert ReasoningGymTask.check_builder_options({"hidden_size": 32}) == []
    assert ReasoningGymTask.check_builder_options({"hidden_sise": 32})
    path = ReasoningGymTask.build_model({"hidden_size": 32, "intermediate_size": 64,
                                         "num_layers": 1}, cache_dir=str(tmp_path))
    tok = AutoTokenizer.from_pretrained(path)
    task = _task(dataset="chain_sum", config={"max_terms": 2, "max_digits": 1},
                 system_prompt="", answer_format="raw", train_size=4)
    for example in task.examples("train", 0):
        for text in (example.prompt, example.answer):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text
