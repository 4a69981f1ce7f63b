"""`peerflow bench reshard` checks its own result: every HF region arrives exactly once.

The bench's correctness check must hold where KV heads are replicated over vLLM's tp
ranks (2 KV heads, tp 4): a `qkv_proj` spec is then a replica as a whole while its query
heads exist on no other rank.
"""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")


@pytest.mark.parametrize("hidden", [512, 1024])
def test_bench_reshard_verifies_small_models_with_and_without_kv_replication(hidden):
    from peerflow.bench import reshard

    args = argparse.Namespace(target_gb=0.005, hidden=hidden, vocab=1000, bucket_mb=4.0,
                              runs=1, threads=1)
    report = reshard.run(args)
    assert report["within_bound"]
    assert report["reshard_gbps"] > 0 and report["staged"]["reshard_gbps"] > 0
