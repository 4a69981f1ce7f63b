"""Function rewards: loading, shapes, validation errors, the limited pool, weighted sets."""

from __future__ import annotations

import logging
import textwrap

import pytest

from peerflow.algorithms.base import Example, RewardFunction
from peerflow.config import load_config, validate_config
from peerflow.errors import ConfigError
from peerflow.rewards import (
    RewardComponent,
    RewardPool,
    RewardSet,
    build_reward_set,
    callable_target,
)
from peerflow.rewards.loading import RewardLoadError, load_function, parse_target, reward_shape

REWARDS = '''
import asyncio
import time


def exact(response, example):
    return float(response.strip() == str(example["answer"]))


def with_metrics(response, example):
    return {"score": float(example["answer"] in response), "length": len(response)}


def lengths(responses, examples):
    return [len(r) / 10 for r in responses]


async def async_exact(response, example):
    await asyncio.sleep(0)
    return response == example["answer"]


async def async_batched(completions, examples):
    return [1.0 for _ in completions]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth) + 0.5 * (data_source == "demo")


def sleeps_forever(response, example):
    if response == "hang":
        time.sleep(10_000)
    return 1.0


def raises(response, example):
    if response == "bad":
        raise ValueError("cannot parse " + response)
    return 0.5


def allocates(response, example):
    if response == "big":
        return len(bytearray(8 * 2**30))
    return 0.25


def returns_text(response, example):
    return "yes"


def three_args(response, example, tokenizer):
    return 1.0


def _private():
    pass
'''


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    return path


def _set(reward_file, plugin_manager, *entries, workers=2, timeout=3.0, memory=1024,
         failure=0.0):
    rewards = [{"fn": f"my_rewards.py:{fn}", "weight": w} for fn, w in entries]
    config = load_config(None, [
        f"task.rewards={rewards}", f"task.reward_limits.workers={workers}",
        f"task.reward_limits.timeout_s={timeout}", f"task.reward_limits.memory_mb={memory}",
        f"task.reward_limits.failure_score={failure}"])
    validate_config(config, plugin_manager)
    return build_reward_set(config.task, plugin_manager, "char_match")


EXAMPLES = [Example(prompt="p", answer="42", index=i, metadata={"data_source": "demo"})
            for i in range(3)]


@pytest.mark.parametrize("workers", [2, 0])
def test_every_shape_scores(reward_file, plugin_manager, workers):
    rewards = _set(reward_file, plugin_manager, ("exact", 1.0), ("with_metrics", 1.0),
                   ("lengths", 1.0), ("async_exact", 1.0), ("async_batched", 1.0),
                   ("compute_score", 1.0), workers=workers)
    shapes = {c.name: c.shape for c in rewards.components}
    assert shapes["lengths"].batched and shapes["async_batched"].batched
    assert shapes["async_exact"].is_async and shapes["compute_score"].verl
    try:
        out = rewards.score(["42", "x42", "7"], EXAMPLES)
    finally:
        rewards.close()
    m = {k: v for k, (v, _) in out.metrics.items()}
    assert m["reward/exact/mean"] == pytest.approx(1 / 3)
    assert m["reward/with_metrics/mean"] == pytest.approx(2 / 3)
    assert m["reward/with_metrics/length"] == pytest.approx(2.0)
    assert m["reward/lengths/mean"] == pytest.approx(0.2)
    assert m["reward/async_exact/mean"] == pytest.approx(1 / 3)
    assert m["reward/async_batched/mean"] == 1.0
    assert m["reward/compute_score/mean"] == pytest.approx(0.5 + 1 / 3)
    # hand-computed totals: exact + with_metrics + lengths + async + 1 + verl
    assert out.total == pytest.approx([1 + 1 + 0.2 + 1 + 1 + 1.5, 0 + 1 + 0.3 + 0 + 1 + 0.5,
                                       0 + 0 + 0.1 + 0 + 1 + 0.5])
    assert out.counts == {"reward/errors": 0, "reward/timeouts": 0}


def test_weights_sum_into_the_total(reward_file, plugin_manager):
    rewards = _set(reward_file, plugin_manager, ("exact", 0.8), ("lengths", 0.2), workers=0)
    out = rewards.score(["42", "12345"], EXAMPLES[:2])
    assert out.total == pytest.approx([0.8 + 0.2 * 0.2, 0.2 * 0.5])


def test_hang_raise_and_memory_cost_one_sample_each(reward_file, plugin_manager, caplog):
    rewards = _set(reward_file, plugin_manager, ("sleeps_forever", 1.0), ("raises", 1.0),
                   ("allocates", 1.0), ("returns_text", 1.0), timeout=2.0, failure=-1.0)
    with caplog.at_level(logging.WARNING, logger="peerflow.rewards"):
        try:
            out = rewards.score(["hang", "bad", "big"], EXAMPLES, sample_ids=[70, 71, 72])
            again = rewards.score(["ok", "ok", "ok"], EXAMPLES)  # the pool recovered
        finally:
            rewards.close()
    m = {k: v for k, (v, _) in out.metrics.items()}
    assert m["reward/sleeps_forever/mean"] == pytest.approx((-1 + 1 + 1) / 3)
    assert m["reward/raises/mean"] == pytest.approx((0.5 - 1 + 0.5) / 3)
    assert m["reward/allocates/mean"] == pytest.approx((0.25 + 0.25 - 1) / 3)
    assert m["reward/returns_text/mean"] == -1.0
    assert out.counts == {"reward/timeouts": 1, "reward/errors": 1 + 1 + 3}
    assert again.counts == {"reward/timeouts": 0, "reward/errors": 3}
    text = caplog.text
    assert "'sleeps_forever'" in text and "sample 70 (prompt #0): timed out after 2 s" in text
    assert "sample 71 (prompt #1): ValueError: cannot parse bad" in text
    assert "sample 72 (prompt #2): MemoryError (over the 1024 MiB memory limit)" in text
    assert "returned str 'yes'" in text


def test_registered_reward_still_works_and_fails_softly(plugin_manager):
    config = load_config(None, ["task.reward=exact_match"])
    rewards = build_reward_set(config.task, plugin_manager, "char_match")
    assert rewards.pool is None
    out = rewards.score(["42", "4"], EXAMPLES[:2])
    assert out.total == [1.0, 0.0] and out.metrics["reward/exact_match/mean"] == (0.5, 2)
    with pytest.raises(ValueError, match="1 responses for 2 examples"):
        rewards.score(["42"], EXAMPLES[:2])

    class Raising(RewardFunction):
        name = "raising"

        def score(self, responses, examples):
            raise RuntimeError("plugin bug")

    broken = RewardSet(components=[RewardComponent(name="raising", function=Raising())],
                       failure_score=-2.0).score(["42", "1"], EXAMPLES[:2])
    assert broken.counts["reward/errors"] == 2 and broken.total == [-2.0, -2.0]


@pytest.mark.parametrize("reference, expected", [
    ("missing.py:exact", r"reward file '.*missing\.py' does not exist"),
    ("my_rewards.py:exakt", r"defines no function 'exakt'\. Did you mean 'exact'\? It defines: "
                            r"allocates, async_batched, .*, with_metrics\."),
    ("my_rewards.py:three_args", r"three_args\(response, example, tokenizer\) has the wrong "
                                 r"signature"),
    ("no_such_pkg.rewards:score", r"cannot import module 'no_such_pkg\.rewards'"),
    ("exact_matsh", r"unknown reward 'exact_matsh' \(task\.reward\)\. Did you mean "
                    r"'exact_match'\?"),
])
def test_bad_references_fail_validation(reward_file, plugin_manager, reference, expected):
    config = load_config(None, [f"task.reward={reference}"])
    with pytest.raises(ConfigError, match=expected):
        validate_config(config, plugin_manager)


def test_reward_and_rewards_together_is_an_error():
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["task.reward=exact_match", "task.rewards=[{fn: contains}]"])


def test_import_error_in_the_file_names_it(tmp_path, plugin_manager):
    bad = tmp_path / "broken.py"
    bad.write_text("import math\nx = 1 / 0\n")
    with pytest.raises(RewardLoadError, match=r"importing reward file .*broken\.py' failed: "
                                              r"ZeroDivisionError"):
        load_function(parse_target(f"{bad}:score"))


def _local_function():
    def inner(response, example):
        return 1.0
    return inner


def test_callables_must_be_importable(reward_file):
    from peerflow.contrib.tasks.rewards import char_match

    assert callable_target(char_match) == "peerflow.contrib.tasks.rewards:char_match"
    fn = load_function(parse_target(f"{reward_file}:exact"))
    assert callable_target(fn) == f"{reward_file}:exact"  # loaded by path: the path again
    with pytest.raises(RewardLoadError, match="lambda or a function defined inside"):
        callable_target(lambda r, e: 1.0)
    with pytest.raises(RewardLoadError, match="lambda or a function defined inside"):
        callable_target(_local_function())


def test_shape_override_and_signature_errors():
    def per_sample(texts, examples):
        return 1.0

    assert reward_shape(per_sample).batched is True
    assert reward_shape(per_sample, batched=False).batched is False
    with pytest.raises(RewardLoadError, match="wrong signature"):
        reward_shape(lambda response: 1.0)


def test_pool_close_is_idempotent():
    pool = RewardPool(workers=1, timeout_s=1, memory_mb=0)
    pool.close()
    pool.close()


def test_source_file_with_main_guard_is_not_rerun(tmp_path, monkeypatch):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent('''
        def score(response, example):
            return 1.0
        if __name__ == "__main__":
            raise SystemExit("re-ran the script")
    '''))
    fn = load_function(parse_target(f"{script}:score"))
    assert fn("a", {}) == 1.0
