"""Mutation test of the suite's LoRA layer: the correct `hf` engine passes it, and each
planted fault of `lora_mutants.py` fails naming the adapter tensor and what to check."""

from __future__ import annotations

import pytest
from lora_mutants import EXPECTED_LORA  # noqa: I001  (tests/conformance is on sys.path)
from test_mutants import HERE, _run

pytest.importorskip("peft")

SUITE = '''
import sys
sys.path.insert(0, {here!r})
import lora_mutants
from peerflow.adapters.hf.engine import HFRolloutEngine
from peerflow.conformance.layer_lora import LayerLora


class TestHF(LayerLora):
    suite_kind = "rollout"
    adapter_class = HFRolloutEngine
{classes}
'''

CLASS = '''
class Test{name}(LayerLora):
    suite_kind = "rollout"
    adapter_class = lora_mutants.{name}
'''


def test_lora_mutants_are_caught_naming_the_tensor(tmp_path):
    source = SUITE.format(here=str(HERE), classes="".join(
        CLASS.format(name=n) for n in EXPECTED_LORA))
    report = _run(tmp_path, source, "qwen2-untied")
    by_class: dict[str, list[dict]] = {}
    for test in report["tests"]:
        by_class.setdefault(test["id"].split("::")[0].removeprefix("Test"), []).append(test)
    correct = by_class["HF"]
    assert sum(t["outcome"] == "passed" for t in correct) == 2, correct
    assert not [t for t in correct if t["outcome"] == "failed"]
    missed = {}
    for name, wanted in EXPECTED_LORA.items():
        text = "\n".join(t["message"] for t in by_class[name] if t["outcome"] == "failed")
        absent = [w for w in wanted if w not in text]
        if not text or absent:
            missed[name] = absent or "not caught"
    assert not missed, missed
