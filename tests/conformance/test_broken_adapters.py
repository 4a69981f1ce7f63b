"""The suite fails deliberately broken adapters, naming the parameter and the region."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).parent

SUITE = '''
import sys
sys.path.insert(0, {here!r})
from {module} import {classes}
from peerflow.conformance.suite import RolloutAdapterSuite
{suites}
'''

CLASS = '''

class Test{cls}(RolloutAdapterSuite):
    adapter_class = {cls}
'''


def run_suite(tmp_path, module: str, classes: list[str], keyword: str, *extra: str):
    test_file = tmp_path / f"test_{module}.py"
    test_file.write_text(SUITE.format(
        here=str(HERE), module=module, classes=", ".join(classes),
        suites="".join(CLASS.format(cls=c) for c in classes)))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider",
         "-p", "no:hypothesispytest",  # the suite uses no hypothesis; its plugin costs ~1 s
         "--rootdir", str(tmp_path), "-o", "addopts=", "-rfE", "-k", keyword, *extra],
        capture_output=True, text=True, env=env, timeout=600)


# Slow tier: test_mutants.py keeps layer 3's catch of a K/V swap (`KVSwapped`) and the
# "uses the data of" diagnosis (`ExpertGateUpSwapped`) in every run, and
# test_conformance_cli.py / test_builtin_adapters.py the real hf engine passing.
@pytest.mark.slow
def test_layer_3_passes_the_real_hf_engine_and_fails_one_swapping_k_and_v(tmp_path):
    result = run_suite(tmp_path, "engine_adapters", ["HFWithHooks", "HFSwapsKV"],
                       "l3_ and llama-tied", "--peerflow-all-failures")
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert failed and all("TestHFSwapsKV" in line for line in failed), out[-3000:]
    assert any("test_l3_load_is_bit_exact" in line for line in failed)
    # The message names the HF parameter, the region and where the wrong values sit.
    assert "model.layers.0.self_attn.k_proj.weight region [0:64, 0:128]" in out
    assert "elements wrong, first at global index (0, 0)" in out
    # The behavioural check names the two parameters mapped crosswise.
    assert "the engine uses the data of model.layers.0.self_attn.k_proj.weight as " \
        "model.layers.0.self_attn.v_proj.weight" in out


@pytest.fixture(scope="module")
def vocab_padding_run(tmp_path_factory) -> tuple[str, dict[str, Counter]]:
    """One suite run over the two vocab-padding adapters (layer 1 and layer 2's canonical
    check, llama-mha-untied at tp2): its output and each class's outcome counts."""
    result = run_suite(
        tmp_path_factory.mktemp("vocab"), "layout_adapters",
        ["BrokenVocabPadding", "VocabPaddingWithXfails"],
        "(TestBrokenVocabPadding and (l1_shards_cover or l2_canonical) or "
        "TestVocabPaddingWithXfails and l1_) and llama-mha-untied and tp2 and not pp2", "-rA")
    assert result.returncode == 1, result.stdout[-3000:]
    outcomes: dict[str, Counter] = {}
    for line in result.stdout.splitlines():
        found = re.match(r"(PASSED|FAILED|XFAIL|XPASS|SKIPPED|ERROR) \S+::Test(\w+)::", line)
        if found:
            outcomes.setdefault(found.group(2), Counter())[found.group(1)] += 1
    return result.stdout, outcomes


def test_vocab_padding_off_by_one_fails_layers_1_and_2(vocab_padding_run):
    out, outcomes = vocab_padding_run
    assert outcomes["BrokenVocabPadding"] == Counter(FAILED=2), out[-3000:]
    # Layer 1: the last real vocabulary row is held by no shard.
    assert "model.embed_tokens.weight: 16 of 1120 elements are held by no shard" in out
    # Layer 2: the planner refuses the plan, naming parameter and region.
    assert "lm_head.weight: region [69:70, 0:16] of source rank 0" in out


def test_expected_failures_are_strict(vocab_padding_run):
    out, outcomes = vocab_padding_run
    # well-formed and replicas pass, coverage fails as declared, the wrongly declared one
    # XPASSes.
    assert outcomes["VocabPaddingWithXfails"] == Counter(FAILED=1, PASSED=2, XFAIL=1), \
        out[-3000:]
    assert "[XPASS(strict)] declared by mistake: this test passes" in out
