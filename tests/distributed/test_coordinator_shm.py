"""The coordinator's shared-memory transport: same results as gloo, cleanup, faults, fallback.

Uses the worker pools of `test_coordinator` (one per world size and core count, spawned
once for this module) and, for a peer that dies, the host fallback and the isolation of
tp peers' batches, processes of their own. A pool told it has fewer cores than a route
has ranks assembles each consumer group's batch on one of as many assemblers as cores
(`coordinator.shared_p2p.assemblers`); one told it has 64 lets every rank assemble its own.
"""

from __future__ import annotations

import functools
import os
import queue
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp

from peerflow.coordinator import pack_batch
from peerflow.coordinator.shm import POOL_FILES, PREFIX, SHM_DIR
from peerflow.launch.warm import warm_context
from peerflow.layout import ParallelLayout
from tests.distributed import test_coordinator
from tests.distributed.test_coordinator import (
    Pool,
    check,
    draw_route_case,
    make_shards,
    route_property,
)
from tests.helpers.gloo import free_port, init_gloo, run_gloo, warm_processes

pytestmark = pytest.mark.distributed

pools = test_coordinator.pools  # the module-scoped pool fixture, one pool per world size


def _files_of(pids) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) for pid in pids
                  if name.startswith(f"{PREFIX}{pid}-"))


@pytest.mark.parametrize("cores", [64, 2, 1])
@route_property(["dp4->dp2xtp2", "dp2@01->dp4", "colocated->split", "split->colocated",
                 "dp3->dp2@12", "dp2->dp1xtp2", "dp2@01->tp2@23"], max_examples=3)
def test_shm_gives_the_same_batches_as_gloo(pools, cores, name, mode, data) -> None:
    world, src, dst, shards_by_dp, shards, use_group = draw_route_case(data, name)
    pool = pools(world, cores)
    by_transport = {}
    for transport in ("shm", "gloo"):
        by_transport[transport] = pool.run(src, dst, shards, mode=mode, use_group=use_group,
                                           transport=transport)
        route = set(src.global_ranks) | set(dst.global_ranks)
        assert {pool.transports[r] for r in route} == {transport}
        check(src, dst, shards_by_dp, by_transport[transport])
    for rank, (batch, _) in by_transport["shm"].items():
        other = by_transport["gloo"][rank][0]
        if batch is None or other is None:
            assert batch is other
        else:
            assert torch.equal(pack_batch(batch), pack_batch(other))


@pytest.mark.parametrize("cores", [64, 1])
def test_segments_are_freed_once_read_and_at_exit(cores) -> None:
    src, dst = ParallelLayout(dp=4), ParallelLayout(dp=2, tp=2)
    pool = Pool(4, cores)
    pids = [p.pid for p in pool.procs]
    try:
        for seed, mode in enumerate(["p2p", "centralized", "p2p", "centralized", "p2p"]):
            shards_by_dp, shards = make_shards(src, [[[5, 9], [3]]] * 4, seed=seed)
            check(src, dst, shards_by_dp, pool.run(src, dst, shards, mode=mode,
                                                   transport="shm"))
        # a sender returns a segment to its route's pool after the exchange in which all
        # its readers read it, and writes the next exchanges into it: what is left is
        # each process's wake-up pipe, its pool (fewer files than the exchanges it wrote)
        # and receivers' links of the last call only (5 calls: indices 0-4)
        files = _files_of(pids)
        assert sorted(name for name in files if name.endswith("-inbox")) == sorted(
            f"{PREFIX}{pid}-inbox" for pid in pids)
        segments = [name for name in files if "-seg" in name]
        links = [name for name in files if "-to" in name]
        assert len(files) == len(pids) + len(segments) + len(links), files
        assert {int(name.split("-")[3]) for name in links} <= {4}, files
        per_process = Counter(name.split("-")[1] for name in segments)
        assert max(per_process.values()) <= min(POOL_FILES, 3), files
    finally:
        pool.close()
    assert _files_of(pids) == []  # pipes included


def _tp_peers_change_their_batches(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import peerflow.coordinator.transport as transport
    from peerflow.coordinator import TransferStats, redistribute, unpack_batch

    transport.usable_cores = lambda: 1  # oversubscribed: rank 0 assembles for rank 1
    src, dst = ParallelLayout(dp=2), ParallelLayout(dp=1, tp=2)
    shards_by_dp, _ = make_shards(src, [[[4, 2], [5]], [[3], [1, 6]]], seed=9)
    shard = shards_by_dp[rank]
    before = pack_batch(shard)
    got = {}
    for call in range(2):
        stats = TransferStats()
        out = redistribute(shard, (src, dst), transport="shm", stats=stats, timeout=60)
        expected = pack_batch(redistribute(shard, (src, dst), transport="gloo", timeout=60))
        dist.barrier()  # both hold their batch before either changes it
        out["response_ids"].values.fill_(-1 - rank)
        out["reward"].add_(100.0 * (rank + 1))
        out["example"][0] = {"text": f"changed by {rank}"}  # (gather shares the objects)
        dist.barrier()  # both changed theirs before either looks
        mine = unpack_batch(expected)
        got[call] = {
            "planned": stats.plan is not None,
            "ids": bool(torch.all(out["response_ids"].values == -1 - rank)),
            "reward": torch.equal(out["reward"], mine["reward"] + 100.0 * (rank + 1)),
            "text": out["example"][0]["text"],
            "rest": torch.equal(out["logprobs"].values, mine["logprobs"].values),
        }
    got["shard"] = torch.equal(pack_batch(shard), before)
    return got


def test_tp_peers_sharing_an_assembly_get_independent_batches() -> None:
    got = run_gloo(_tp_peers_change_their_batches, 2)
    for rank in (0, 1):
        for call in (0, 1):
            row = got[rank][call]
            assert row["planned"] == (rank == 0)  # only the group's first rank planned
            assert row["ids"] and row["reward"] and row["rest"], (rank, call, row)
            assert row["text"] == f"changed by {rank}"
        assert got[rank]["shard"]  # the producer's own shard is untouched


def _same(a, b) -> bool:
    """Whether two batches hold the same fields, values and objects (pickled bytes of the
    objects may differ in memo references, so not `pack_batch` bytes)."""
    (meta_a, tensors_a), (meta_b, tensors_b) = a.to_wire(), b.to_wire()
    return meta_a == meta_b and len(tensors_a) == len(tensors_b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(tensors_a, tensors_b))


def _assemblers_over_changing_shapes(rank: int, world: int, pool_file_bytes: int) -> dict:
    import peerflow.coordinator.shm as shm
    import peerflow.coordinator.transport as transport
    from peerflow.coordinator import TransferStats, redistribute

    transport.usable_cores = lambda: 2  # 4 ranks on 2 cores: 2 assemblers
    shm.POOL_FILE_BYTES = pool_file_bytes
    wide, narrow = ParallelLayout(dp=4), ParallelLayout(dp=2, tp=2)
    rows, kept = [], []
    # shapes change every call: lengths, group counts, routes (4 or 2 consumer groups)
    for call, (src, dst, groups) in enumerate([
            (narrow, wide, [[[5, 9], [3]], [[7, 1, 4], [2]]]),
            (wide, narrow, [[[30]], [[1, 2], [3]], [[12, 5]], [[4]]]),
            (narrow, wide, [[[2], [40, 1]], [[3], [3], [3], [9, 9]]])]):
        shards_by_dp, _ = make_shards(src, groups, seed=call)
        shard = shards_by_dp[rank // 2 if src == narrow else rank]
        stats = TransferStats()
        out = redistribute(shard, (src, dst), transport="shm", stats=stats, timeout=60)
        expected = redistribute(shard, (src, dst), transport="gloo", timeout=60)
        rows.append({"planned": stats.plan is not None,
                     "same": _same(out, expected),
                     "samples": len(out)})
        kept.append((out, expected))
    # later calls rewrote the senders' pooled segments: earlier batches are unchanged
    return {"rows": rows, "pid": os.getpid(), "kept": [_same(*pair) for pair in kept]}


@pytest.mark.parametrize("pool_file_bytes", [64 * 2**20, 0])
def test_assemblers_one_per_core_give_gloo_batches_across_changing_shapes(
        pool_file_bytes) -> None:
    """With 0, no segment is small enough to reuse: receivers map them instead of
    reading them out, and senders remove them once read."""
    got = run_gloo(functools.partial(_assemblers_over_changing_shapes,
                                     pool_file_bytes=pool_file_bytes), 4)
    for rank in range(4):
        for call, row in enumerate(got[rank]["rows"]):
            assert row["same"], (rank, call)
            # two assemblers, the first ranks of consumer groups 0 and 1: to dp4 ranks
            # 0 and 1 (each builds two groups' batches), to dp2×tp2 ranks 0 and 2
            assemblers = {0, 2} if call == 1 else {0, 1}
            assert row["planned"] == (rank in assemblers), (rank, call)
        assert all(got[rank]["kept"]), rank
    assert sum(got[r]["rows"][0]["samples"] for r in range(4)) == 7  # one copy each
    assert _files_of([got[r]["pid"] for r in range(4)]) == []  # all freed at exit


def _dies_after_one_call(rank: int, world: int, port: int, mode: str, results) -> None:
    from peerflow.coordinator import redistribute
    from peerflow.errors import WorkerFailedError

    init_gloo(rank, world, port)
    src, dst = ParallelLayout(dp=2), ParallelLayout(dp=1, tp=2)
    shards_by_dp, _ = make_shards(src, [[[4, 2]], [[3], [1]]], seed=7)
    redistribute(shards_by_dp[rank], (src, dst), mode=mode, transport="shm", timeout=60)
    if rank == 1:
        os._exit(0)  # dies between two calls: never publishes its second shard
    try:
        redistribute(shards_by_dp[rank], (src, dst), mode=mode, transport="shm", timeout=3)
        results.put("no error")
    except WorkerFailedError as exc:
        results.put((str(exc), [name for name in _files_of([os.getpid()])
                                if not name.endswith("-inbox")]))


@pytest.mark.parametrize("mode", ["p2p", "centralized"])
def test_a_dead_peer_is_a_clear_error_and_leaves_no_segments(mode) -> None:
    results = warm_context().Queue()
    port = free_port()
    with warm_processes(_dies_after_one_call, [(r, 2, port, mode, results)
                                               for r in range(2)]) as procs:
        try:
            got = results.get(timeout=120)
        except queue.Empty:
            pytest.fail("rank 0 neither failed nor finished within 120 s")
    assert got != "no error"
    message, files = got
    assert "rank(s) [1] did not answer within 3 s" in message and "shared memory" in message
    assert files == []
    assert _files_of([procs[0].pid]) == []  # its wake-up pipe is gone at exit


def _two_hosts(rank: int, world: int) -> dict:
    import peerflow.coordinator.transport as transport
    from peerflow.coordinator import TransferStats, redistribute

    if rank == 1:  # this rank claims another host: the route cannot share memory
        transport.host_identity = lambda: "elsewhere/boot/1:1"
    src, dst = ParallelLayout(dp=2), ParallelLayout(dp=1, tp=2)
    shards_by_dp, _ = make_shards(src, [[[4, 2]], [[3], [1]]], seed=8)
    stats = TransferStats()
    out = redistribute(shards_by_dp[rank], (src, dst), transport="auto", stats=stats,
                       timeout=60)
    try:
        redistribute(shards_by_dp[rank], (src, dst), transport="shm", timeout=60)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"transport": stats.transport, "ids": sorted(out.sample_id.tolist()),
            "refused": refused}


def test_ranks_on_two_hosts_fall_back_to_gloo_and_refuse_shm() -> None:
    got = run_gloo(_two_hosts, 2)
    for rank in (0, 1):
        assert got[rank]["transport"] == "gloo"
        assert got[rank]["ids"] == [0, 1, 2, 3]
        assert "transport='shm' but the route's ranks are on 2 hosts" in got[rank]["refused"]


def test_unknown_transport_is_refused_naming_the_choices() -> None:
    from peerflow.coordinator import redistribute

    with pytest.raises(ValueError, match=r"transport='tcp'; use one of \('auto', 'gloo', 'shm'\)"):
        redistribute(None, (ParallelLayout(dp=1), ParallelLayout(dp=1)), transport="tcp")


def test_a_full_dev_shm_names_the_fix(monkeypatch, tmp_path) -> None:
    import errno

    from peerflow.coordinator import shm

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "pwrite", full)
    fd = os.open(tmp_path / "segment", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="shm-size.*coordinator_transport: gloo"):
            shm._write_all(fd, memoryview(b"payload"), 0)
    finally:
        os.close(fd)


def _world_after_destroy(rank: int, port: int, out) -> None:
    import gc
    import weakref

    import torch.distributed as dist

    from peerflow.coordinator.transport import open_channel
    from peerflow.reshard.transports import SharedMemoryTransport

    init_gloo(rank, 2, port)
    coordinator = open_channel((0, 1), "shm", timeout=60)
    weights = SharedMemoryTransport(rank=rank).route()
    assert weights is not coordinator  # one cache, a route (call counter) per namespace
    routes = [weakref.ref(coordinator), weakref.ref(weights)]
    del coordinator, weights
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    out.put((rank, world() is None and all(route() is None for route in routes)))


def test_a_destroyed_process_group_is_not_kept_alive_by_the_routes() -> None:
    """The route cache must not hold the world group (its gloo threads) past its
    destruction: C++ threads torn down at interpreter exit abort the process
    ("terminate called without an active exception", seen at the end of bench runs).
    Its routes — the coordinator's and the weight sync's — go with the group."""
    ctx = mp.get_context("spawn")  # not warm_process: a fork-server child skips shutdown
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_world_after_destroy, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        freed = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
    assert freed == {0: True, 1: True}
    assert [p.exitcode for p in procs] == [0, 0]
