"""`peerflow bench moe`: the same batch scored with routing replay off and r3."""

from __future__ import annotations

import argparse


def test_bench_moe_reports_both_modes_and_replay_agreement():
    from peerflow.bench import moe

    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    result = moe.run(parser.parse_args(["--prompts", "16", "--n", "4",  # seeded
                                        "--layers", "2"]))  # the 6-layer default is slower
    assert result["rollout"]["dtype"] == "bfloat16" and result["sampled_tokens"] > 0
    off, r3 = result["off"], result["r3"]
    assert "moe/replay_changed" not in off  # nothing replayed with replay off
    assert r3["moe/replay_no_overlap"] == 0.0 and 0 < r3["moe/replay_changed"] < 0.1
    assert r3["mean_abs_logprob_diff"] < off["mean_abs_logprob_diff"]
    assert result["abs_diff_ratio_off_over_r3"] == (
        off["mean_abs_logprob_diff"] / r3["mean_abs_logprob_diff"])
