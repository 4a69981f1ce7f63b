"""`peerflow bench train` at a tiny shape: both layouts step the same batch; the
padding-free one computes no padding and the JSON carries every figure."""

from __future__ import annotations

import argparse


def test_bench_train_reports_both_layouts(tmp_path):
    from peerflow.bench import train as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args([
        "--prompts", "2", "--group-size", "3", "--prompt-tokens", "6", "--max-tokens", "24",
        "--repeats", "1", "--micro-batch-tokens", "64"]))
    padded, packed = result["layouts"]["padded"], result["layouts"]["padding_free"]
    assert result["samples"] == 6 and result["median_of"] == 1
    assert packed["padding_fraction"] == 0.0 and 0 <= padded["padding_fraction"] < 1
    assert packed["positions"] <= padded["positions"]
    assert result["unique_tokens"] < result["real_tokens"]  # each prompt computed once
    for figures in (padded, packed):
        assert figures["tokens_per_s"] == result["real_tokens"] / figures["step_s"]
        assert figures["peak_memory_gib"] > 0 and figures["mfu"] is None
    assert result["speedup"] == padded["step_s"] / packed["step_s"]


def test_benchmark_page_stays_a_reference():
    """docs/benchmarks.md: under 300 lines, and every `peerflow bench NAME` it names
    exists."""
    import re
    from pathlib import Path

    from peerflow.cli.bench_cmd import BENCHMARKS

    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) < 300
    named = set(re.findall(r"peerflow bench ([a-z0-9-]+)", page))
    assert named and named <= set(BENCHMARKS), named - set(BENCHMARKS)
