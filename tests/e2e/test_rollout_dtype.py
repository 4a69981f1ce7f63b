"""`rollout.dtype`: a bfloat16 rollout beside float32 trainer weights (verl's GPU setup)."""

import math


def test_a_bfloat16_rollout_learns_from_float32_weights_sent_at_half_the_bytes(
        tmp_path, quickstart, tiny, metrics_of, peerflow_train, quickstart_run):
    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*tiny, "run.steps=2", "rollout.dtype=bfloat16"])
    rows = metrics_of(run_dir)
    float32 = metrics_of(quickstart_run)[0]  # the same run with the rollout in model.dtype
    assert [m["step"] for m in rows] == [1, 2]
    for row in rows:
        # the trainer's float32 weights travel as the bfloat16 the rollout holds
        assert row["weight_sync/bytes"] == float32["weight_sync/bytes"] / 2
        # the rounding shows as a log-prob mismatch the float32 rollout does not have,
        # small beside the log-probs themselves; the off-policy correction takes it
        assert float32["mismatch/abs_max"] < 1e-4 < row["mismatch/abs_max"] < 0.5
        assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0
