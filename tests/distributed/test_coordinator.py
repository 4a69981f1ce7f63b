"""Peer-to-peer redistribution between layouts, on 2, 3 and 4 gloo processes.

One pool of worker processes per world size, spawned once for the module; hypothesis
draws ragged batches in the test process, every rank redistributes its shard, and the
test checks conservation, group integrity, byte-exact payloads, extra fields and the
token-load balance against the exact optimum.
"""

from __future__ import annotations

import itertools
import queue

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerflow.batch import Batch, RaggedField
from peerflow.coordinator import dp_members, pack_batch, unpack_batch
from peerflow.coordinator.exchange import HEAD_BYTES
from peerflow.coordinator.wire import size_bound
from peerflow.distributed.init import free_port
from peerflow.launch.warm import warm_context
from peerflow.layout import ParallelLayout
from tests.helpers.gloo import init_gloo, warm_process

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, port: int, tasks, results, cores: int | None) -> None:
    import torch.distributed as dist

    import peerflow.coordinator.transport
    from peerflow.coordinator import TransferStats, redistribute

    if cores is not None:  # the cores a shared-memory route sees (tp peers share from 1)
        peerflow.coordinator.transport.usable_cores = lambda: cores
    init_gloo(rank, world, port)
    subgroups = {}
    for ranks in itertools.chain.from_iterable(
            itertools.combinations(range(world), k) for k in range(2, world)):
        subgroups[ranks] = dist.new_group(list(ranks))
    while True:
        task = tasks.get()
        if task is None:
            break
        src, dst, mode, shard, use_group, transport = task
        batch = unpack_batch(shard) if shard is not None else None
        participants = tuple(sorted(set(src.global_ranks) | set(dst.global_ranks)))
        stats = TransferStats()
        if rank not in participants and use_group:
            results.put((rank, None, None, None))
            continue
        group = subgroups.get(participants) if use_group else None
        try:
            out = redistribute(batch, (src, dst), group, mode=mode, transport=transport,
                               timeout=60, stats=stats)
            results.put((rank, pack_batch(out), (stats.bytes_sent, stats.bytes_received),
                         stats.transport))
        except Exception as exc:  # report, keep serving
            results.put((rank, None, repr(exc), None))
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, cores: int | None = None) -> None:
        ctx = warm_context()
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.transports: dict[int, str | None] = {}
        self.procs = [warm_process(_worker, (r, world, port, self.tasks[r], self.results,
                                             cores), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, src, dst, shards, mode="p2p", use_group=False, transport="auto"):
        for rank in range(self.world):
            self.tasks[rank].put((src, dst, mode, shards.get(rank), use_group, transport))
        out, failures = {}, []
        for _ in range(self.world):  # every answer, so none is left for the next test
            try:
                rank, packed, info, self.transports[rank] = self.results.get(timeout=120)
            except queue.Empty:
                raise AssertionError("a worker did not answer within 120 s") from None
            if packed is None and isinstance(info, str):
                failures.append(f"rank {rank} failed: {info}")
            out[rank] = (unpack_batch(packed) if packed is not None else None, info)
        if failures:
            raise AssertionError("; ".join(failures))
        return out

    def close(self) -> None:
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def pools():
    made: dict[tuple[int, int | None], Pool] = {}

    def get(world: int, cores: int | None = None) -> Pool:
        if (world, cores) not in made:
            made[world, cores] = Pool(world, cores)
        return made[world, cores]

    yield get
    for pool in made.values():
        pool.close()


def make_shards(src: ParallelLayout, groups_per_dp: list[list[list[int]]], seed: int):
    """Builds one batch per producer dp-rank: groups of samples with given response lengths."""
    gen = torch.Generator().manual_seed(seed)
    shards_by_dp = []
    sample = 0
    group = 0
    for dp, groups in enumerate(groups_per_dp):
        sids, gids, prompts, responses, objects = [], [], [], [], []
        for lengths in groups:
            plen = int(torch.randint(1, 6, (1,), generator=gen))
            prompt = torch.randint(0, 1000, (plen,), generator=gen)
            for length in lengths:
                sids.append(sample)
                gids.append(group)
                prompts.append(prompt)
                responses.append(torch.randint(0, 1000, (length,), generator=gen))
                objects.append({"sample": sample, "text": "x" * (sample % 5)})
                sample += 1
            group += 1
        n = len(sids)
        batch = Batch(sample_id=sids, group_id=gids, weight_version=[dp] * n)
        batch.set("prompt_ids", RaggedField.from_tensors(prompts, dtype=torch.int64))
        batch.set("response_ids", RaggedField.from_tensors(responses, dtype=torch.int64))
        batch.set("logprobs", RaggedField.from_tensors(
            [torch.randn(len(r), generator=gen) for r in responses], dtype=torch.float32))
        batch.set("hidden", RaggedField.from_tensors(
            [torch.randn(len(r), 3, generator=gen).to(torch.bfloat16) for r in responses],
            dtype=torch.bfloat16))
        batch.set("reward", torch.randn(n, generator=gen, dtype=torch.float64))
        batch.set("mask", torch.rand(n, 2, generator=gen) > 0.5)
        batch.set_objects("example", objects)
        shards_by_dp.append(batch)
    members = dp_members(src)
    shards = {}
    for dp, batch in enumerate(shards_by_dp):
        for r in members[dp]:
            shards[r] = pack_batch(batch)
    return shards_by_dp, shards


def optimal_peak(loads: list[int], bins: int) -> int:
    """Exact minimum of the busiest bin (branch and bound; small inputs only)."""
    loads = sorted(loads, reverse=True)
    best = [sum(loads)]
    totals = [0] * bins

    def go(i: int) -> None:
        if i == len(loads):
            best[0] = min(best[0], max(totals))
            return
        seen = set()
        for b in range(bins):
            if totals[b] in seen or totals[b] + loads[i] >= best[0]:
                continue
            seen.add(totals[b])
            totals[b] += loads[i]
            go(i + 1)
            totals[b] -= loads[i]

    go(0)
    return best[0]


def check(src, dst, shards_by_dp, out) -> None:
    original = Batch.concat(shards_by_dp)
    by_id = {int(s): i for i, s in enumerate(original.sample_id)}
    members = dp_members(dst)
    seen: list[int] = []
    loads = []
    for ranks in members:
        first = out[ranks[0]][0]
        for r in ranks[1:]:  # tp/pp peers of a consumer dp-rank hold identical bytes
            assert torch.equal(pack_batch(out[r][0]), pack_batch(first))
        seen += first.sample_id.tolist()
        assert set(first.fields) == set(original.fields)  # extra fields preserved
        for i, sid in enumerate(first.sample_id.tolist()):
            j = by_id[sid]
            assert int(first.group_id[i]) == int(original.group_id[j])
            assert int(first.weight_version[i]) == int(original.weight_version[j])
            for name, col in original.fields.items():
                got = first.fields[name]
                if isinstance(col, RaggedField):
                    a, b = got.row(i), col.row(j)
                    assert a.dtype == b.dtype
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                elif isinstance(col, torch.Tensor):
                    assert got.dtype == col.dtype and torch.equal(got[i], col[j])
                else:
                    assert got[i] == col[j]
        loads.append(int(first.token_count().sum()))
    # conservation: every sample exactly once over the consumer dp-ranks
    assert sorted(seen) == sorted(original.sample_id.tolist())
    # group integrity: a group lives on one consumer dp-rank only
    owner: dict[int, int] = {}
    for dp, ranks in enumerate(members):
        for g in out[ranks[0]][0].group_id.tolist():
            assert owner.setdefault(g, dp) == dp
    for r, (batch, _) in out.items():
        if r not in dst.global_ranks and batch is not None:
            assert len(batch) == 0
    group_loads: dict[int, int] = {}
    for g, t in zip(original.group_id.tolist(), original.token_count().tolist()):
        group_loads[g] = group_loads.get(g, 0) + t
    if group_loads:
        best = optimal_peak(list(group_loads.values()), dst.dp)
        assert max(loads) <= 1.10 * best, (loads, best)


lengths = st.lists(st.integers(0, 40), min_size=1, max_size=4)
groups_strategy = st.lists(lengths, min_size=0, max_size=3)

ROUTES = {
    # name: (world, src, dst)
    "dp4->dp2xtp2": (4, ParallelLayout(dp=4), ParallelLayout(dp=2, tp=2)),
    "dp2->dp4": (4, ParallelLayout(dp=2, tp=2), ParallelLayout(dp=4)),
    "dp2@01->dp4": (4, ParallelLayout(dp=2, ranks=(0, 1)), ParallelLayout(dp=4)),
    "colocated->split": (4, ParallelLayout(dp=4), ParallelLayout(dp=2, ranks=(2, 3))),
    "split->colocated": (4, ParallelLayout(dp=2, ranks=(2, 3)), ParallelLayout(dp=4)),
    "dp3->dp2": (3, ParallelLayout(dp=3), ParallelLayout(dp=2)),
    "dp3->dp2@12": (3, ParallelLayout(dp=3), ParallelLayout(dp=2, ranks=(1, 2))),
    "dp2->dp1xtp2": (2, ParallelLayout(dp=2), ParallelLayout(dp=1, tp=2)),
    "dp2@01->tp2@23": (4, ParallelLayout(dp=2, ranks=(0, 1)),
                       ParallelLayout(dp=1, tp=2, ranks=(2, 3))),
    "split1->1": (2, ParallelLayout(dp=1, ranks=(0,)), ParallelLayout(dp=1, ranks=(1,))),
}


def draw_route_case(data, name: str):
    """`(world, src, dst, shards_by_dp, shards, use_group)` of route `name`, drawn."""
    world, src, dst = ROUTES[name]
    groups = [data.draw(groups_strategy, label=f"dp{d}") for d in range(src.dp)]
    seed = data.draw(st.integers(0, 2**16), label="seed")
    use_group = len(set(src.global_ranks) | set(dst.global_ranks)) < world and data.draw(
        st.booleans(), label="subgroup")
    return world, src, dst, *make_shards(src, groups, seed), use_group


def route_property(names, max_examples: int):
    """A hypothesis test over routes `names` × both modes (`name`, `mode`, `data` args)."""
    def wrap(test):
        test = given(data=st.data())(test)
        test = settings(max_examples=max_examples, deadline=None, derandomize=True,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])(test)
        test = pytest.mark.parametrize("mode", ["p2p", "centralized"])(test)
        return pytest.mark.parametrize("name", names)(test)
    return wrap


@route_property(list(ROUTES), max_examples=4)
def test_redistribute(pools, name, mode, data) -> None:
    world, src, dst, shards_by_dp, shards, use_group = draw_route_case(data, name)
    out = pools(world).run(src, dst, shards, mode=mode, use_group=use_group)
    check(src, dst, shards_by_dp, out)


def test_equal_layouts_move_nothing(pools) -> None:
    layout = ParallelLayout(dp=2, tp=2)
    shards_by_dp, shards = make_shards(layout, [[[3, 4]], [[5], [1, 2]]], seed=1)
    out = pools(4).run(layout, layout, shards)
    assert all(info == (0, 0) for _, info in out.values())
    check(layout, layout, shards_by_dp, out)


def test_p2p_busiest_rank_moves_less_than_centralized(pools) -> None:
    src, dst = ParallelLayout(dp=4), ParallelLayout(dp=2, tp=2)
    groups = [[[30] * 4, [20] * 4] for _ in range(4)]
    shards_by_dp, shards = make_shards(src, groups, seed=3)
    p2p = pools(4).run(src, dst, shards, mode="p2p")
    central = pools(4).run(src, dst, shards, mode="centralized")
    check(src, dst, shards_by_dp, p2p)
    check(src, dst, shards_by_dp, central)
    busiest = {m: max(sum(info) for _, info in res.values())
               for m, res in (("p2p", p2p), ("centralized", central))}
    assert busiest["centralized"] > 1.5 * busiest["p2p"], busiest


def test_missing_load_fields_is_an_error_naming_the_fields(pools) -> None:
    src, dst = ParallelLayout(dp=2), ParallelLayout(dp=1, tp=2)
    shards_by_dp, _ = make_shards(src, [[[3, 4]], [[5]]], seed=2)
    members = dp_members(src)
    shards = {}
    for dp, batch in enumerate(shards_by_dp):
        bare = Batch(sample_id=batch.sample_id, group_id=batch.group_id,
                     weight_version=batch.weight_version)
        bare.set("tokens", batch["response_ids"])
        for r in members[dp]:
            shards[r] = pack_batch(bare)
    with pytest.raises(AssertionError) as failure:
        pools(2).run(src, dst, shards)
    message = str(failure.value)
    assert "none of the load fields ['prompt_ids', 'response_ids']" in message
    assert "it has ['tokens']" in message and "load_fields=" in message


@pytest.mark.parametrize("mode", ["p2p", "centralized"])
def test_messages_larger_than_a_receive_arrive_in_two_parts(pools, mode) -> None:
    # 720 samples a producer: the metadata (24 bytes a sample) and the centralized
    # gather and scatter exceed `exchange.HEAD_BYTES`, so they travel as head + tail
    # (a gloo matter: the shared-memory transport has no receive capacities).
    src, dst = ParallelLayout(dp=2), ParallelLayout(dp=1, tp=2)
    groups = [[[3, 5, 1, 7, 2, 4, 6, 8]] * 90 for _ in range(2)]
    shards_by_dp, shards = make_shards(src, groups, seed=4)
    assert all(len(b) * 24 > HEAD_BYTES for b in shards_by_dp)
    check(src, dst, shards_by_dp, pools(2).run(src, dst, shards, mode=mode, transport="gloo"))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(groups=st.lists(groups_strategy, min_size=1, max_size=2), data=st.data())
def test_size_bound_holds_for_every_subset(groups, data) -> None:
    shards_by_dp, _ = make_shards(ParallelLayout(dp=len(groups)), groups, seed=5)
    batch = Batch.concat(shards_by_dp)
    per_sample, fixed = size_bound(batch)
    indices = data.draw(st.lists(st.sampled_from(range(len(batch))), unique=True)
                        if len(batch) else st.just([]), label="indices")
    packed = pack_batch(batch.select(indices))
    assert packed.numel() <= fixed + int(per_sample[torch.tensor(indices, dtype=torch.int64)].sum())
    assert int(packed[:8].view(torch.int64)[0]) == packed.numel()  # self-sized message
