"""Planted generate-contract and replica faults fail conformance naming the check, and an
optional capability's failure leaves the core layers run and reported.

One pytest subprocess runs layers 1, 2 and the generate contract over the correct
`HFWithLayout` and every class of `contract_mutants.py` (llama models); a second runs
the core layer 3 and the LoRA group over a LoRA mutant.
"""

from __future__ import annotations

import pytest
from contract_mutants import EXPECTED_CONTRACT  # noqa: I001  (tests/conformance is on sys.path)
from test_mutants import HERE, _run

SUITE = '''
import sys
sys.path.insert(0, {here!r})
import contract_mutants, mutants
from peerflow.conformance.layers import Layer1Layouts, Layer2RoundTrip
from peerflow.conformance.layer_generate import LayerGenerate
{classes}
'''

CLASS = '''
class Test{name}(Layer1Layouts, Layer2RoundTrip, LayerGenerate):
    suite_kind = "rollout"
    adapter_class = {module}.{name}
'''


def _by_class(report: dict) -> dict[str, list[dict]]:
    by_class: dict[str, list[dict]] = {}
    for test in report["tests"]:
        by_class.setdefault(test["id"].split("::")[0].removeprefix("Test"), []).append(test)
    return by_class


def test_planted_contract_faults_fail_naming_the_check(tmp_path):
    classes = CLASS.format(name="HFWithLayout", module="mutants") + "".join(
        CLASS.format(name=n, module="contract_mutants") for n in EXPECTED_CONTRACT)
    report = _run(tmp_path, SUITE.format(here=str(HERE), classes=classes),
                  "llama and (single or dp2 or generate)")
    by_class = _by_class(report)
    control = by_class["HFWithLayout"]
    assert not [t for t in control if t["outcome"] == "failed"], control
    assert sum(t["outcome"] == "passed" and "generate" in t["id"] for t in control) >= 9
    missed = {}
    for name, (test, layer, wanted) in EXPECTED_CONTRACT.items():
        failed = [t for t in by_class[name] if t["outcome"] == "failed" and
                  t["id"].split("::")[1].startswith(test)]
        text = "\n".join(t["message"] for t in failed)
        absent = [w for w in wanted if w not in text]
        if not failed or absent or {t["layer"] for t in failed} != {layer}:
            missed[name] = absent or f"{test} did not fail in layer {layer}"
    assert not missed, missed


LORA_SUITE = '''
import sys
sys.path.insert(0, {here!r})
import lora_mutants
from peerflow.conformance.layer3_rollout import Layer3RolloutEngine
from peerflow.conformance.layer_lora import LayerLora


class TestLoraWrongScaling(LayerLora, Layer3RolloutEngine):  # LoRA tests run first
    suite_kind = "rollout"
    adapter_class = lora_mutants.LoraWrongScaling
'''


def test_a_failing_optional_layer_leaves_the_core_layers_run_and_reported(tmp_path):
    """The LoRA group fails first; every core layer-3 test still runs and passes."""
    pytest.importorskip("peft")
    report = _run(tmp_path, LORA_SUITE.format(here=str(HERE)), "qwen2-untied")
    tests = report["tests"]
    lora = [t for t in tests if t["group"] == "lora"]
    core = [t for t in tests if t["group"] == "core"]
    assert any(t["outcome"] == "failed" for t in lora), lora
    assert core and all(t["outcome"] in ("passed", "skipped") for t in core), core
    assert sum(t["outcome"] == "passed" for t in core) >= 6, core
    assert not [t for t in core if "already failed" in t["message"]], core
    assert not report["passed"]
