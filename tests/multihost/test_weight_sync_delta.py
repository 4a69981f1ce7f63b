"""Delta weight sync across two hosts on a rate-limited link (issue 43, must-show).

Two network namespaces act as two machines (`tests/multihost/netns.py`); `tc` caps what
each host sends. `peerflow bench weight-sync --split` runs under `torchrun
--nnodes 2`: the trainer on h0, the rollout on h1, in bf16, each run one real optimiser
step at lr 1e-6 (weights at a pretrained model's scale, `--init-range 0.02`), then a
full and a delta sync of the same weights. Delta must send ≥ 10x fewer bytes, finish
sooner on the slow link, and leave the rollout bit-identical to the full sync every run.
The default `weight_sync.encoding: auto` takes delta on these routes (different hosts).
Marked slow (two torchrun agents and real train steps: 21 s idle, ~1.5 min on a busy
machine); the
protocol itself is covered fast by `tests/distributed/test_delta_sync.py`.
"""

from __future__ import annotations

import pytest
from netns import unavailable  # this folder's helpers (pytest puts it on sys.path)
from sync_bench import split_bench

_REASON = unavailable()
pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(_REASON is not None, reason=f"multi-host tests: {_REASON}")]
RATE = "40mbit"


def test_delta_sync_across_hosts_sends_10x_fewer_bytes_and_is_faster_on_a_slow_link(
        hosts, tmp_path) -> None:
    for i in range(2):  # either host may get the trainer's rank
        if reason := hosts.limit_rate(i, RATE):
            pytest.skip(f"cannot rate-limit the link here: {reason}")
    got, results = split_bench(hosts, ["--shape", "quickstart", "--init-range", "0.02",
                                       "--runs", "3", "--prompts", "2", "--group-size", "4"],
                               tmp_path / "sync.json", timeout=600)
    assert got, results
    full, delta = got["encodings"]["full"], got["encodings"]["delta"]
    print(f"{RATE}: full {full['wire_bytes']} B {full['total_s']:.3f} s, delta "
          f"{delta['wire_bytes']} B {delta['total_s']:.3f} s, changed "
          f"{delta['changed_share']:.4f}")
    assert got["bit_identical"] and got["bit_identical_runs"] == 4, got
    assert got["bytes_full_over_delta"] >= 10, got
    assert delta["total_s"] < full["total_s"], got
    assert delta["full_sends"] == [0, 0, 0], got
    assert got["auto_encoding"] == "delta", got  # the routes cross hosts
