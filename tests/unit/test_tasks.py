"""Tasks, rewards and the tiny-model builder."""

from __future__ import annotations

import json

import pytest

from peerflow.algorithms.base import Example
from peerflow.config import structure_options
from peerflow.contrib.tasks.dataset import DatasetOptions, DatasetTask
from peerflow.contrib.tasks.generated import (
    ArithmeticOptions,
    ArithmeticTask,
    ReverseDigitsOptions,
    ReverseDigitsTask,
)
from peerflow.contrib.tasks.rewards import char_match
from peerflow.errors import ConfigError


def test_registered_through_hooks(plugin_manager):
    tasks = set(plugin_manager.registry("task").names())
    assert {"reverse-digits", "arithmetic", "dataset"} <= tasks
    assert {"char_match", "char_match_strict", "exact_match", "contains"} <= set(
        plugin_manager.registry("reward").names())
    task_cls = plugin_manager.get("task", "reverse-digits")
    assert task_cls.default_reward in plugin_manager.registry("reward")


def test_reverse_digits_is_deterministic_and_indexable():
    task = ReverseDigitsTask(ReverseDigitsOptions(digits=4, train_size=50, eval_size=5))
    first = list(task.examples("train", seed=3))
    assert first == list(task.examples("train", seed=3))
    assert first != list(task.examples("train", seed=4))
    assert task.example("train", 17, seed=3) == first[17]
    assert task.size("train") == 50 and len(list(task.examples("eval", 0))) == 5
    assert list(task.examples("eval", 0)) == list(task.examples("eval", 9))  # eval is fixed
    for ex in first:
        digits = ex.prompt[:-1]
        assert ex.prompt.endswith(">") and len(digits) == 4 and ex.answer == digits[::-1]
    with pytest.raises(IndexError, match="out of range"):
        task.example("train", 50, seed=3)


def test_arithmetic_sums_and_no_carry():
    task = ArithmeticTask(ArithmeticOptions(digits=3, train_size=200))
    for ex in task.examples("train", 0):
        a, b = ex.prompt[:-1].split("+")
        assert int(a) + int(b) == int(ex.answer) and len(a) == 3 and len(b) == 3
    easy = ArithmeticTask(ArithmeticOptions(digits=3, operands=3, no_carry=True, train_size=200))
    for ex in easy.examples("train", 0):
        numbers = ex.prompt[:-1].split("+")
        for column in zip(*numbers):
            assert sum(map(int, column)) <= 9
        assert all(n[0] != "0" for n in numbers)


def test_rewards_hand_computed(plugin_manager):
    examples = [Example(prompt="123>", answer="321")] * 5
    responses = ["321", "391", "3215", " 321 ", "9"]
    get = lambda name: plugin_manager.get("reward", name)()  # noqa: E731
    assert get("char_match").score(responses, examples) == [1, 2 / 3, 1, 1, 0]
    assert get("char_match_strict").score(responses, examples) == [1, 2 / 3, 3 / 4, 1, 0]
    assert get("exact_match").score(responses, examples) == [1, 0, 0, 1, 0]
    assert get("contains").score(responses, examples) == [1, 0, 1, 1, 0]
    assert char_match("", "") == 1.0
    with pytest.raises(ValueError, match="2 responses for 1 examples"):
        get("exact_match").score(["a", "b"], examples[:1])


def test_task_options_are_strict():
    with pytest.raises(ConfigError, match="task.options.digit: unknown key. Did you mean 'digits'"):
        structure_options(ReverseDigitsOptions, {"digit": 3}, "task.options")
    with pytest.raises(ConfigError, match="min_digits"):
        structure_options(ReverseDigitsOptions, {"digits": 2, "min_digits": 3}, "task.options")


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"question": f"q{i}", "solution": str(i)} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_dataset_task_jsonl_and_parquet(jsonl, tmp_path):
    task = DatasetTask(DatasetOptions(path=str(jsonl), prompt_column="question",
                                      answer_column="solution", eval_fraction=0.2))
    assert task.size("train") == 8 and task.size("eval") == 2
    train = list(task.examples("train", seed=1))
    assert sorted(e.index for e in train) == list(range(8))
    assert train == list(task.examples("train", seed=1))
    assert [e.index for e in train] != list(range(8))  # shuffled by the seed
    assert task.example("train", 3, seed=1) == train[3]
    assert all(e.prompt == f"q{e.index}" and e.answer == str(e.index) for e in train)
    assert [e.index for e in task.examples("eval", 0)] == [8, 9]
    import datasets

    parquet = tmp_path / "data.parquet"
    datasets.Dataset.from_dict({"prompt": ["a", "b"], "answer": [1, 2]}).to_parquet(str(parquet))
    ptask = DatasetTask(DatasetOptions(path=str(parquet), shuffle=False))
    assert [(e.prompt, e.answer) for e in ptask.examples("train", 0)] == [("a", 1), ("b", 2)]


def test_dataset_errors_name_the_row_and_column(jsonl, tmp_path):
    with pytest.raises(ConfigError, match=r"no column 'prompt'.*\['question', 'solution'\]"):
        DatasetTask(DatasetOptions(path=str(jsonl))).size("train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "answer": "1"}\n{"prompt": "", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"line 2: column 'prompt' is ''"):
        DatasetTask(DatasetOptions(path=str(bad))).size("train")
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"prompt": "ok", "answer": null}\n')
    with pytest.raises(ConfigError, match=r"line 1: column 'answer' is empty"):
        DatasetTask(DatasetOptions(path=str(missing))).size("train")
    with pytest.raises(ConfigError, match="is not a file"):
        DatasetTask(DatasetOptions(path=str(tmp_path / "nope.jsonl"))).size("train")


def test_tiny_model_builder_is_cached_and_loads(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ReverseDigitsTask.build_model({"hidden_size": 64, "intermediate_size": 128},
                                         str(tmp_path))
    again = ArithmeticTask.build_model({"hidden_size": 64, "intermediate_size": 128},
                                       str(tmp_path))
    assert path == again  # same alphabet and options -> same cache entry
    other = ReverseDigitsTask.build_model({"hidden_size": 64, "intermediate_size": 128,
                                           "seed": 1}, str(tmp_path))
    assert other != path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tokenizer)
    text = "12+345=678>"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text  # one token per char
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "123>"}],
                                              add_generation_prompt=True, tokenize=False)
    assert templated == "<s>123>"
    with pytest.raises(ConfigError, match="model.builder_options.hidden: unknown key"):
        ReverseDigitsTask.build_model({"hidden": 3}, str(tmp_path))


def _verl_rows():
    return [{
        "data_source": "demo/math",
        "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i},
    } for i in range(6)]


def test_verl_parquet_loads_as_it_is(tmp_path):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(_verl_rows()).to_parquet(str(path))
    task = DatasetTask(DatasetOptions(path=str(path), answer_column="reward_model.ground_truth",
                                      system_prompt="Answer in \\boxed{}.", shuffle=False))
    first = next(task.examples("train", 0))
    assert first.prompt == [{"role": "system", "content": "Answer in \\boxed{}."},
                            {"role": "user", "content": "What is 0 + 0?"}]
    assert first.answer == "0" and first.metadata["data_source"] == "demo/math"
    assert first.metadata["extra_info"] == {"split": "train", "index": 0}
    assert [e.answer for e in task.examples("train", 0)] == ["0", "2", "4", "6", "8", "10"]


def test_save_to_disk_directories_and_their_splits(tmp_path):
    import datasets

    rows = _verl_rows()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}
                         ).save_to_disk(str(tmp_path / "dd"))
    task = DatasetTask(DatasetOptions(path=str(tmp_path / "dd"), eval_split="test",
                                      answer_column="reward_model.ground_truth"))
    assert task.size("train") == 4 and task.size("eval") == 2
    with pytest.raises(ConfigError, match=r"has splits \['test', 'train'\], not 'valid'"):
        DatasetTask(DatasetOptions(path=str(tmp_path / "dd"), eval_split="valid",
                                   answer_column="reward_model.ground_truth")).size("eval")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    single = DatasetTask(DatasetOptions(path=str(tmp_path / "single"),
                                        answer_column="reward_model.ground_truth"))
    assert single.size("train") == 6


def test_chat_prompts_render_with_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from peerflow.rollout.prompts import encode_prompt

    path = ReverseDigitsTask.build_model({"hidden_size": 32, "intermediate_size": 64},
                                         str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "system", "content": "12"}, {"role": "user", "content": "34>"}]
    assert tokenizer.decode(encode_prompt(tokenizer, chat)) == "<s>1234>"
    assert encode_prompt(tokenizer, "34>") == encode_prompt(tokenizer, chat[1:])


@pytest.mark.parametrize("content, expected", [
    (b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n',
     r"line 2: byte b'\\xe9' at column 16 is not UTF-8\. Re-encode the file as UTF-8"),
    (b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": }\n',
     r"line 2, column 27: not valid JSON .*Fix or delete that line"),
    # a line cut short is named where it ends (column 1 of a next line, before)
    (b'{"prompt": "a", "answer": "1"}\r\n{"prompt": "b", "answer": "2"\r\n',
     r"line 2, column 30: not valid JSON \(Expecting ',' delimiter\)"),
    (b"", r"the dataset is empty \(no rows\); add at least one row"),
    (b"\n\n", r"the dataset is empty"),
    (b'["prompt", "answer"]\n', r"line 1: is a JSON list, not an object"),
    (b'{"prompt": [{"role": "user"}], "answer": "1"}\n',
     r"line 1: column 'prompt' message 0 is .*needs a role .* and a string content"),
])
def test_dataset_file_errors_name_the_line_and_fix(tmp_path, content, expected):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=expected) as info:
        DatasetTask(DatasetOptions(path=str(path))).size("train")
    assert str(path) in str(info.value)


def test_a_split_left_empty_is_an_error(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n')
    with pytest.raises(ConfigError, match="leaves no rows to train on"):
        DatasetTask(DatasetOptions(path=str(path), eval_fraction=0.9)).size("train")
