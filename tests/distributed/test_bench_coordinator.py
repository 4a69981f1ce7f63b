"""`peerflow bench coordinator` on a small batch: its JSON, and the checks it makes."""

from __future__ import annotations

import json

import pytest

from peerflow.cli import main


@pytest.mark.distributed
def test_bench_coordinator_reports_both_modes_beside_a_plain_send(tmp_path, capsys):
    out = tmp_path / "coordinator.json"
    main(["bench", "coordinator", "--nprocs", "2,4", "--groups", "8", "--group-size", "4",
          "--mean-tokens", "16", "--runs", "1", "--simulate", "8", "--transport", "auto,gloo",
          "--json", str(out)])
    doc = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == doc
    assert doc["benchmark"] == "coordinator" and doc["median_of"] == 1
    timed = [r for r in doc["results"] if r["mode"] in ("p2p", "centralized")]
    # every (N, transport, mode), each having moved all 32 samples (the bench checks it)
    assert sorted({(r["nprocs"], r["transport"], r["mode"]) for r in timed}) == [
        (n, t, m) for n in (2, 4) for t in ("gloo", "shm") for m in ("centralized", "p2p")]
    assert all(r["samples"] == 32 and r["wall_s"] > 0 and r["busiest_rank_bytes"] > 0
               for r in timed)
    plain = {(r["nprocs"], r["mode"]) for r in doc["results"] if r["mode"].endswith("_send")}
    assert plain == {(n, m) for n in (2, 4) for m in ("gloo_send", "shm_send")}
    for n in ("2", "4"):
        ratios = doc["ratios"][n]
        assert ratios["transport"] == "shm" and set(ratios["by_transport"]) == {"shm", "gloo"}
        assert ratios["wall_p2p_over_centralized"] > 0
    assert {r["nprocs"] for r in doc["simulation"]} == {8}
    wire = doc["wire"]  # the step batch's pack and unpack, header included
    assert wire["header_bytes"] > 0 and wire["pack_us"] > 0 and wire["unpack_us"] > 0


def test_bench_coordinator_rejects_an_odd_process_count():
    with pytest.raises(SystemExit, match="even counts"):
        main(["bench", "coordinator", "--nprocs", "3"])
