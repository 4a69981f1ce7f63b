"""What the coordinator and the async stream balance (`units.Balance`): with consumers that
run a prompt once for all its samples (`shares_prompts`), groups stay whole and a group's
prompt counts once."""

from __future__ import annotations

import pytest
import torch

from peerflow.batch import Batch
from peerflow.coordinator.transfer import plan_transfer
from peerflow.coordinator.units import Balance, prompt_shares
from peerflow.layout import ParallelLayout
from peerflow.planner.plan import Route
from peerflow.streaming.assignment import TokenBalancer
from peerflow.worker.program import RouteStep, roles_sharing_prompts
from tests.helpers.gloo import run_gloo


def _shard(groups: list[tuple[int, int, list[int]]], first_id: int = 0) -> Batch:
    """One dp-shard: `(group id, prompt length, answer lengths)` per group."""
    gids, prompts, responses = [], [], []
    for gid, plen, lengths in groups:
        for length in lengths:
            gids.append(gid)
            prompts.append(torch.full((plen,), 7))
            responses.append(torch.full((length,), 9))
    n = len(gids)
    batch = Batch(sample_id=torch.arange(n) + first_id, group_id=torch.tensor(gids),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("prompt_ids", prompts)
    batch.set("response_ids", responses)
    return batch


def test_a_shared_prompt_is_spread_over_its_samples_in_the_shard():
    # group 4: prompt 10 over 3 answers; group 2: prompt 5 over 2 (split from the rest of
    # its group, which is on another shard); group 9: one answer
    batch = _shard([(4, 10, [1, 2, 3]), (2, 5, [6, 7]), (9, 3, [8])])
    assert prompt_shares(batch).tolist() == [4, 3, 3, 3, 2, 3]
    shared = Balance(keep_groups=False, shared_prompts=True)
    loads = shared.loads(batch)
    assert loads.tolist() == [5, 5, 6, 9, 9, 11]
    # per group, the loads sum to what its row costs: the prompt once, every answer
    assert [int(loads[:3].sum()), int(loads[3:5].sum()), int(loads[5])] == [16, 18, 11]
    # and the units are the groups, kept whole (a re-balance: no locality slack)
    assert shared.units(batch).tolist() == [4, 4, 4, 2, 2, 9] and shared.slack == 0.0
    # not shared: each sample carries the whole prompt and is a unit of its own, as before
    single = Balance(keep_groups=False)
    assert single.loads(batch).tolist() == [11, 12, 13, 11, 12, 11]
    assert torch.equal(single.units(batch), batch.sample_id) and single.slack == 0.0
    assert torch.equal(Balance().loads(batch), batch.token_count())


def test_a_dropped_sample_weighs_nothing_and_leaves_its_share_to_the_others():
    batch = _shard([(0, 9, [4, 5, 6]), (1, 4, [2])])
    batch.set("train_mask", torch.tensor([False, True, True, False]))
    rebalance = Balance(keep_groups=False, shared_prompts=True)
    assert rebalance.loads(batch).tolist() == [0, 5 + 5, 6 + 4, 0]
    # a group route (before the advantage step) does not apply train_mask
    grouped = Balance(keep_groups=True, shared_prompts=True)
    assert grouped.loads(batch).tolist() == [4 + 3, 5 + 3, 6 + 3, 2 + 4]


def test_without_the_prompt_field_shared_loads_count_what_is_there():
    batch = _shard([(0, 6, [3, 4])])
    shared = Balance(keep_groups=False, shared_prompts=True)
    assert Balance(fields=("response_ids",), shared_prompts=True).loads(batch).tolist() == [3, 4]
    del batch.fields["prompt_ids"]
    assert shared.loads(batch).tolist() == [3, 4]
    assert shared.loads(Batch.empty()).tolist() == []


def _row_costs(shards: list[Batch], plan, dp: int) -> list[int]:
    """What each consumer's shared-prompt rows cost: every answer, each group's prompt once."""
    costs, prompts = [0] * dp, [set() for _ in range(dp)]
    for shard, targets in zip(shards, plan.dst_of_sample, strict=True):
        for i, d in enumerate(targets):
            costs[d] += int(shard.lengths("response_ids")[i])
            group = int(shard.group_id[i])
            if group not in prompts[d]:
                prompts[d].add(group)
                costs[d] += int(shard.lengths("prompt_ids")[i])
    return costs


def _costs(layout: ParallelLayout, shards: list[Batch], balance: Balance) -> list[int]:
    plan = plan_transfer(layout, layout, [balance.units(s).tolist() for s in shards],
                         [balance.loads(s).tolist() for s in shards], balance.slack)
    return _row_costs(shards, plan, layout.dp)


def _shards(gen: torch.Generator, dp: int, groups: int, answers: int,
            mean: float) -> list[Batch]:
    """`groups` groups per dp-rank: prompts of 16–511 tokens, exponential answer lengths."""
    shards = []
    for r in range(dp):
        made = []
        for g in range(groups):
            prompt = int(torch.randint(16, 512, (1,), generator=gen))
            lengths = (torch.empty(answers).exponential_(1 / mean, generator=gen) + 1).long()
            made.append((r * groups + g, prompt, lengths.tolist()))
        shards.append(_shard(made, first_id=r * groups * answers))
    return shards


@pytest.mark.parametrize(("dp", "groups"), [(2, 4), (4, 4), (2, 1)])
def test_balancing_shared_prompt_rows_evens_what_they_cost(dp, groups):
    """A re-balance for a trainer that shares prompts, scored by what its rows cost (each
    prompt once per rank that holds some of its answers, every answer): balancing single
    samples weighed prompt + answer splits groups, each split paying its prompt again, and
    on average costs the busiest rank more than not balancing at all; keeping groups whole
    weighed by their rows never costs more than not balancing, and on average less."""
    gen = torch.Generator().manual_seed(dp * 10 + groups)
    layout = ParallelLayout(dp=dp)
    peaks: dict[str, list[int]] = {"home": [], "samples": [], "shared": []}
    for _ in range(40):
        shards = _shards(gen, dp, groups, answers=8, mean=128)
        home = _costs(layout, shards, Balance(keep_groups=True, fields=()))  # all loads 0
        peaks["home"].append(max(home))
        peaks["samples"].append(max(_costs(layout, shards, Balance(keep_groups=False))))
        shared = _costs(layout, shards, Balance(keep_groups=False, shared_prompts=True))
        peaks["shared"].append(max(shared))
        assert max(shared) <= max(home)
        assert sum(shared) == sum(home)  # no prompt runs twice
    mean = {name: sum(values) / len(values) for name, values in peaks.items()}
    assert mean["samples"] > mean["home"], mean
    if groups > 1:
        assert mean["shared"] < 0.95 * mean["home"], mean


class _Engine:
    def __init__(self, shares: bool) -> None:
        self.shares_prompts = shares


def _step(src_role: str, dst_role: str) -> RouteStep:
    layout = ParallelLayout(dp=2)
    return RouteStep(route=Route(name="r", src=layout, dst=layout, src_role=src_role,
                                 dst_role=dst_role, keep_groups=False))


def test_a_route_counts_prompts_once_where_its_consumer_role_shares_them():
    sharing = {"actor": True, "critic": False, "rollout": False}
    assert _step("actor", "actor").consumers_share_prompts(sharing)
    # between roles too: every rank knows every role's fact, producer-only ranks included
    assert _step("rollout", "actor").consumers_share_prompts(sharing)
    assert not _step("critic", "critic").consumers_share_prompts(sharing)
    assert not _step("actor", "ref").consumers_share_prompts(sharing)  # no fact: no


def test_the_async_stream_weighs_a_group_by_what_its_trainer_runs():
    long_prompt = _shard([(0, 100, [10, 10, 10, 10])])  # 4 × 110 = 440; shared: 140
    long_answers = _shard([(1, 10, [60, 60, 60, 60])])  # 280; shared: 250
    short = _shard([(2, 10, [20, 20, 20, 20])])
    per_answer = TokenBalancer(num_consumers=2)
    shared = TokenBalancer(num_consumers=2, shared_prompts=True)
    for balancer in (per_answer, shared):
        assert [balancer.assign_group(0, g) for g in (long_prompt, long_answers)] == [0, 1]
    assert per_answer.tokens[0] == [440, 280] and shared.tokens[0] == [140, 250]
    # the third group goes where it costs the trainers least: to the one whose prompt
    # was long only if that prompt runs once
    assert per_answer.assign_group(0, short) == 1 and shared.assign_group(0, short) == 0
    clone = TokenBalancer.from_state_dict(shared.state_dict())
    assert clone.shared_prompts and clone.tokens == shared.tokens


def _gathered_facts(rank: int, world: int) -> dict[str, bool]:
    # rank 0 rolls out; ranks 1 and 2 train and hold a critic, whose engine on rank 2
    # cannot share prompts (say, another attention backend): the role then does not
    engines = [{"rollout": object()},
               {"actor": _Engine(True), "critic": _Engine(True)},
               {"actor": _Engine(True), "critic": _Engine(False)}][rank]
    return roles_sharing_prompts(engines)


def test_every_rank_learns_every_roles_prompt_sharing():
    expected = {"rollout": False, "actor": True, "critic": False}
    assert run_gloo(_gathered_facts, 3) == {rank: expected for rank in range(3)}
    assert roles_sharing_prompts({"actor": _Engine(True)}) == {"actor": True}  # no group
