"""The suite fails deliberately broken adapters, naming the parameter and the region."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_vocab_padding_off_by_one_fails_layers_1_and_2(tmp_path):
    result = run_suite(tmp_path, "layout_adapters", ["BrokenVocabPadding"],
                       "(l1_shards_cover or l2_canonical) and llama-mha-untied and tp2 "
                       "and not pp2")
    assert result.returncode == 1, result.stdout[-3000:]
    out = result.stdout
    assert "2 failed" in out
    # Layer 1: the last real vocabulary row is held by no shard.
    assert "model.embed_tokens.weight: 16 of 1120 elements are held by no shard" in out
    # Layer 2: the planner refuses the plan, naming parameter and region.
    assert "lm_head.weight: region [69:70, 0:16] of source rank 0" in out


def test_expected_failures_are_strict(tmp_path):
    result = run_suite(tmp_path, "layout_adapters", ["VocabPaddingWithXfails"],
                       "l1_ and llama-mha-untied and tp2 and not pp2")
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    # well-formed passes, coverage fails as declared, the wrongly declared one XPASSes.
    assert "1 failed, 1 passed" in out and "1 xfailed" in out, out[-3000:]
    assert "[XPASS(strict)] declared by mistake: this test passes" in out
