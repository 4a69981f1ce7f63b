"""`peerflow conformance NAME`: table per layer and capability, JSON report, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def peerflow(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "peerflow", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_conformance_hf_prints_table_and_writes_json(tmp_path):
    report_path = tmp_path / "hf.json"
    result = peerflow("conformance", "hf", "--json", str(report_path), "-k",
                      "l0_ or (l2_canonical and llama-mha-untied)")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "peerflow conformance hf on cpu" in out and "rollout engine" in out
    assert "layer capability" in out and "PASSED" in out
    report = json.loads(report_path.read_text())
    assert report["adapter"] == "hf" and report["passed"] is True and report["device"] == "cpu"
    assert report["engines"][0]["kind"] == "rollout"
    layers = {row["layer"] for row in report["layers"]}
    assert {0, 2} <= layers
    assert report["summary"]["failed"] == 0
    assert sum(report["summary"].values()) == len(report["tests"]) > 0
    skipped = [t for t in report["tests"] if t["outcome"] == "skipped"]
    # The hf engine has no tensor parallelism: tp layouts skip naming the capability.
    assert any(t["capability"] == "tensor_parallel" and "Capabilities.tensor_parallel"
               in t["message"] for t in skipped)


def test_conformance_unknown_adapter_lists_installed_ones():
    result = peerflow("conformance", "no-such-engine")
    assert result.returncode == 1
    assert "unknown rollout backend 'no-such-engine'" in result.stderr
    assert "hf" in result.stderr
