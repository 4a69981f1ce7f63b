"""Nothing silent about rewards: TRL-style functions, NaN, a raising batched call, chat
prompts without a chat template, and the per-run watch over reward failures."""

from __future__ import annotations

import json
import logging
import textwrap

import pytest

from peerflow.algorithms.base import Example
from peerflow.config import load_config, validate_config
from peerflow.errors import ConfigError
from peerflow.rewards import build_reward_set

REWARDS = textwrap.dedent('''
    import math


    def trl_truth(completions, ground_truth, **kwargs):
        """A TRL user's reward: the dataset column `ground_truth` as a keyword list."""
        step = kwargs["trainer_state"].global_step
        kwargs["log_metric"]("first_id", kwargs["completion_ids"][0][0])
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [float(c.strip() == t) + step for c, t in zip(texts, ground_truth)]


    def trl_plain(completions, ground_truth, **kwargs):
        return [float(c == t) for c, t in zip(completions, ground_truth)]


    def trl_prompts(prompts, completions, **kwargs):
        """TRL's other common form; chat prompts give chat completions."""
        return [float(p[-1]["content"] in c[0]["content"]) if isinstance(p, list)
                else float(p in c) for p, c in zip(prompts, completions)]


    def trl_needs_solution(completions, solution, **kwargs):
        return [1.0 for _ in completions]


    def nan_for_x(response, example):
        return math.nan if "x" in response else 1.0


    def quoting_raise(response, example):
        raise ValueError(f"cannot parse {response!s}")


    def batch_raising(completions, examples):
        return [1.0 / (len(c) - 3) for c in completions]  # "bad" (3 letters) divides by 0
''')

ROWS = [Example(prompt="12", answer="21", index=i, metadata={"ground_truth": truth})
        for i, truth in enumerate(["21", "7", "3"])]


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    (tmp_path / "faults.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "faults.py"


def _rewards(plugin_manager, *names, workers=0, **limits):
    config = load_config(None, [
        f"task.rewards={[{'fn': f'faults.py:{n}'} for n in names]}",
        f"task.reward_limits.workers={workers}",
        *[f"task.reward_limits.{k}={v}" for k, v in limits.items()]])
    validate_config(config, plugin_manager)
    return config, build_reward_set(config.task, plugin_manager, "char_match")


@pytest.mark.parametrize("workers", [0, 2])
def test_trl_style_rewards_get_dataset_columns_as_keyword_lists(reward_file, plugin_manager,
                                                                workers):
    _, plain = _rewards(plugin_manager, "trl_plain", workers=workers)
    try:  # it used to get the examples as `ground_truth` and score 0
        assert plain.score(["21", "8"], ROWS[:2]).total == [1.0, 0.0]
    finally:
        plain.close()
    _, rewards = _rewards(plugin_manager, "trl_truth", "trl_prompts", workers=workers)
    chat = Example(prompt=[{"role": "user", "content": "3"}], answer="3", index=3,
                   metadata={"ground_truth": "3"})
    try:
        out = rewards.score(["21", " 7", "12x", " 3"], [*ROWS, chat],
                            context={"completion_ids": [[5, 6], [7], [8], [9]], "step": 3,
                                     "steps": 4})
    finally:
        rewards.close()
    # step 3 is sampled after 2 optimizer steps: trainer_state.global_step == 2
    assert out.components["trl_truth"] == [3.0, 3.0, 2.0, 3.0]
    assert out.components["trl_prompts"] == [0.0, 0.0, 1.0, 1.0]
    assert out.metrics["reward/trl_truth/first_id"] == (5.0, 4)
    assert not any(out.failed) and not out.errors
    assert all(c.shape.trl and c.shape.batched for c in rewards.components)


def test_a_trl_keyword_that_is_no_column_is_refused_before_the_run(reward_file,
                                                                   plugin_manager):
    from peerflow.rewards.setup import check_reward_columns

    config, _ = _rewards(plugin_manager, "trl_needs_solution", "trl_truth")
    problems = check_reward_columns(config, plugin_manager, ROWS[0])
    assert len(problems) == 1
    assert "'solution'" in problems[0] and "ground_truth" in problems[0]
    assert "task.rewards[0].fn" in problems[0] and "Rename the parameter" in problems[0]


def test_nan_rewards_name_the_settings_that_decide_their_fate(reward_file, plugin_manager,
                                                              caplog):
    _, rewards = _rewards(plugin_manager, "nan_for_x", on_failure="mask")
    with caplog.at_level(logging.WARNING, logger="peerflow.rewards"):
        out = rewards.score(["1", "x", "2"], ROWS)
    assert out.failed == [False, True, False]
    assert [e.sample_id for e in out.errors] == [1]
    assert "returned nan" in out.errors[0].message
    assert "task.reward_limits.on_failure=mask" in caplog.text
    assert "left out of training" in caplog.text and "failure_score" in caplog.text


def test_a_failure_quoting_model_text_is_logged_escaped(reward_file, plugin_manager, caplog):
    """A response that clears the screen and writes the clipboard reaches the log as text."""
    _, rewards = _rewards(plugin_manager, "quoting_raise")
    hostile = "\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07\u202e"
    with caplog.at_level(logging.WARNING, logger="peerflow.rewards"):
        out = rewards.score([hostile, "1", "2"], ROWS)
    assert out.failed == [True, True, True]
    assert "\x1b" not in caplog.text and "\u202e" not in caplog.text
    assert "cannot parse \\x1b[2J\\x1b]52;c;" in caplog.text
    assert hostile in out.errors[0].message  # reward_errors.jsonl keeps the text as raised


@pytest.mark.parametrize("workers", [0, 2])
def test_a_raising_batched_reward_costs_only_the_sample_it_raises_on(reward_file,
                                                                     plugin_manager, workers):
    _, rewards = _rewards(plugin_manager, "batch_raising", workers=workers)
    try:
        out = rewards.score(["good", "bad", "longer"], ROWS, sample_ids=[40, 41, 42])
    finally:
        rewards.close()
    assert out.failed == [False, True, False]
    assert out.components["batch_raising"] == pytest.approx([1.0, 0.0, 1 / 3])
    (error,) = out.errors
    assert (error.sample_id, error.reward, error.prompt_index) == (41, "batch_raising", 1)
    assert "ZeroDivisionError" in error.message
    assert "Traceback" in error.traceback and "len(c) - 3" in error.traceback


def test_reward_errors_are_appended_as_json_lines(tmp_path):
    from peerflow.outputs.reward_errors import append_reward_errors, last_reward_error
    from peerflow.rewards.scoring import RewardError

    errors = [RewardError(reward="r", sample_id=i, prompt_index=i, status="error",
                          message="boom", traceback=f"line {i}") for i in range(2)]
    assert append_reward_errors(tmp_path, 1, 0, errors) == 2
    append_reward_errors(tmp_path, 2, 1, errors[:1])
    lines = (tmp_path / "reward_errors.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 1, 2]
    assert last_reward_error(tmp_path, "r")["rank"] == 1


def test_chat_prompts_without_a_chat_template_are_an_error_naming_the_fix(
        tmp_path, plugin_manager, tiny_model):
    from transformers import AutoTokenizer

    from peerflow.agents.tools import render_prompt
    from peerflow.launch.preflight import check_dataset
    from peerflow.rollout.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert not tokenizer.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2"}]
    with pytest.raises(ConfigError, match="no chat template.*chat_template.*text prompts"):
        encode_prompt(tokenizer, chat)
    assert encode_prompt(tokenizer, "1+2") == tokenizer("1+2")["input_ids"]
    # a text prompt with tools PeerFlow describes itself is still joined
    text = tokenizer.decode(render_prompt(tokenizer, [{"role": "user", "content": "1+2"}],
                                          [{"name": "calc", "parameters": {}}]),
                            skip_special_tokens=True)
    assert text.endswith("\n1+2") and "calc" in text
    # `config validate` and `train` say so before any worker starts
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": chat, "answer": "3"}) + "\n")
    config = load_config(None, [f"model.path={tiny_model}", "task.name=dataset",
                                f"task.options={{path: {tmp_path / 'rows.jsonl'}}}"])
    (problem,) = check_dataset(config, plugin_manager)
    assert "has no chat template" in problem and "model.path=" in problem


def test_reward_watch_stops_after_steps_of_failing_on_everything(tmp_path):
    from peerflow.outputs.reward_errors import append_reward_errors
    from peerflow.rewards.scoring import RewardError
    from peerflow.worker.reward_watch import RewardFailedError, RewardWatch

    append_reward_errors(tmp_path, 2, 0, [RewardError(
        reward="grader", sample_id=7, prompt_index=3, status="error", message="KeyError: 'x'",
        traceback="Traceback ...\n  File \"grader.py\", line 4")])
    watch = RewardWatch(run_dir=tmp_path, fatal_after_steps=2, max_failure_share=0.5)
    everything = {"samples": 8.0, "reward/failed_samples": 8.0, "reward/grader/failed": 8.0}
    watch.check(1, everything)
    watch.check(2, {"samples": 8.0, "reward/failed_samples": 1.0, "reward/grader/failed": 1.0})
    watch.check(3, everything)  # the streak starts again
    with pytest.raises(RewardFailedError) as info:
        watch.check(4, everything)
    message = str(info.value)
    assert "'grader' failed on every sample of the last 2 steps" in message
    assert "Sample 7 (dataset row 4): KeyError: 'x'" in message and 'grader.py", line 4' in message
    assert "fatal_after_steps" in message


def test_reward_watch_tallies_and_fails_past_the_share(tmp_path, caplog):
    from peerflow.worker.reward_watch import RewardFailedError, RewardWatch

    watch = RewardWatch(run_dir=tmp_path, max_failure_share=0.2)
    for step in (1, 2):
        watch.check(step, {"samples": 10.0, "reward/failed_samples": 2.0 + step,
                           "reward/a/failed": 2.0, "reward/b/failed": float(step)})
    with caplog.at_level(logging.WARNING, logger="peerflow.worker"), \
            pytest.raises(RewardFailedError, match=r"35\.0% .*max_failure_share=0\.2"):
        watch.finish(reports=True)
    tally = json.loads((tmp_path / "reward_errors.json").read_text())
    assert tally == {"samples": 20, "failed_samples": 7, "share": 0.35,
                     "by_reward": {"a": 4, "b": 3}, "max_failure_share": 0.2,
                     "exceeded": True}
    assert "7 of 20 trained samples" in caplog.text
    RewardWatch(run_dir=tmp_path).finish(reports=False)  # nothing failed: quiet
