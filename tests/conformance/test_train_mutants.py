"""Mutation test of the train layer: the six mistakes of a third-party trainer, each named.

One pytest subprocess on the emulated accelerator (`PEERFLOW_EMULATE_ACCELERATOR=1`, so
device tensors are real and a model left on the host fails) runs the suite over the
example `ddp` engine (every layer-3 test) and each mutant of `train_mutants.py` (the test
that must catch it), then reads the JSON report: the control passes, every mutant fails
its test with the cause and the author's method in the message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_mutants import EXPECTED_TRAIN  # noqa: I001  (tests/conformance is on sys.path)

from peerflow.testing.env import ENV_VAR

HERE = Path(__file__).parent

SUITE = '''
import sys
sys.path.insert(0, {here!r})
import train_mutants
from peerflow.conformance import TrainAdapterSuite
from peerflow_example_plugin.trainer import DDPTrainEngine


class TestDDP(TrainAdapterSuite):
    adapter_class = DDPTrainEngine
{classes}
'''

CLASS = '''
class Test{name}(TrainAdapterSuite):
    adapter_class = train_mutants.{name}
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, list[dict]]:
    """The suite's JSON report over the control and the mutants, tests by class name."""
    tmp = tmp_path_factory.mktemp("train-suite")
    (tmp / "test_train_suite_run.py").write_text(SUITE.format(
        here=str(HERE), classes="".join(CLASS.format(name=n) for n in EXPECTED_TRAIN)))
    keyword = " or ".join(["(TestDDP and l3_)"] + [
        f"(Test{name} and {test} and llama-tied)" for name, (test, _) in EXPECTED_TRAIN.items()])
    out = tmp / "report.json"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **{ENV_VAR: "1"})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp / "test_train_suite_run.py"), "-q",
         "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--rootdir", str(tmp),
         "-o", "addopts=", "--tb=short", "-k", keyword, "--peerflow-report", str(out)],
        capture_output=True, text=True, env=env, timeout=900, check=False)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    by_class: dict[str, list[dict]] = {}
    for test in json.loads(out.read_text())["tests"]:
        by_class.setdefault(test["id"].split("::")[0].removeprefix("Test"), []).append(test)
    return by_class


def test_example_trainer_passes_the_train_layer_on_the_emulated_device(report):
    tests = report["DDP"]
    assert not [(t["id"], t["message"]) for t in tests if t["outcome"] == "failed"]
    passed = {t["id"].split("::")[-1].split("[")[0] for t in tests if t["outcome"] == "passed"}
    assert {"test_l3_train_step_matches_reference", "test_l3_train_step_dp2_matches_reference",
            "test_l3_train_shared_prompts_match_unshared",
            "test_l3_train_checkpoint_round_trip"} <= passed, passed


@pytest.mark.parametrize("mutant", list(EXPECTED_TRAIN))
def test_planted_trainer_mistake_fails_naming_it(report, mutant):
    test_name, wanted = EXPECTED_TRAIN[mutant]
    failed = [t for t in report[mutant] if t["outcome"] == "failed" and test_name in t["id"]]
    text = "\n".join(t["message"] for t in failed)
    assert failed, (mutant, [(t["id"], t["outcome"]) for t in report[mutant]])
    assert all(w in text for w in wanted), (mutant, [w for w in wanted if w not in text], text)
