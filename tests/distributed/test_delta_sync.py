"""Delta weight sync (`weight_sync.encoding='delta'`) over two gloo processes, in bf16.

Rank 0 trains (Megatron layout), rank 1 serves (vLLM layout). Every version is synced
twice, by a delta service and a full one, into two rollout engines: after each version
both hold the same bits, equal to the trainer's weights cut to the vLLM layout. Between
versions the trainer's fp32 master weights take Adam steps on random gradients and are
cast to bf16, so only some bf16 values change. The receiver also restarts from an older
copy (its held version no longer matches: the sender resends whole) and silently
corrupts its copy (the checksum names the tensor; the next sync resends whole).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gloo import run_gloo

pytestmark = pytest.mark.distributed

CONFIG = dict(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
)
BUCKET = 8 * 1024


def _bits(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.view(torch.int16).clone() for name, t in tensors.items()}


def _same(a: dict, b: dict) -> list[str]:
    return [name for name in a if not torch.equal(a[name], b[name])]


class _Master:
    """fp32 master weights stepped by Adam; `bf16()` is what a bf16 trainer holds."""

    def __init__(self, shapes: dict) -> None:
        g = torch.Generator().manual_seed(0)
        self.params = {
            n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for n, s in shapes.items()
        }
        # an RL learning rate: ~1 % of bf16 values move per step
        self.optim = torch.optim.Adam(self.params.values(), lr=1e-6)
        self.g = torch.Generator().manual_seed(1)

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.g)
        self.optim.step()

    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in self.params.items()}


def _worker(rank: int, world: int) -> dict:
    import attrs

    from peerflow.conformance.oracle import cut
    from peerflow.engines import WeightSyncStats
    from peerflow.errors import ConfigError, ShardError
    from peerflow.models import hf_parameters, megatron_layout, vllm_layout
    from peerflow.reshard import WeightSyncService, plan_weight_sync
    from peerflow.reshard.delta import DeltaTransport, _Copy
    from tests.helpers.tensor_engines import TensorRollout, TensorTrainer

    master = _Master(hf_parameters(CONFIG))
    specs = megatron_layout(CONFIG, dtype="bfloat16")
    trainer = rollout = reference = None
    if rank == 0:
        full = master.bf16()
        trainer = TensorTrainer(specs, {s.local_name: cut(s, full).clone() for s in specs})
    else:
        rollout = TensorRollout(vllm_layout(CONFIG, dtype="bfloat16"))
        reference = TensorRollout(vllm_layout(CONFIG, dtype="bfloat16"))
    plan = plan_weight_sync(trainer, rollout)
    out: dict = {"errors": []}
    for bad in (
        dict(encoding="zip"),
        dict(encoding="delta", transport="torch_broadcast"),
        dict(encoding="delta", full_every=-1),
    ):
        try:
            WeightSyncService.build(trainer, rollout, plan=plan, bucket_bytes=BUCKET, **bad)
        except ConfigError as exc:
            out["errors"].append(str(exc))
    auto = WeightSyncService.build(
        trainer, rollout, plan=plan, bucket_bytes=BUCKET, transport="torch"
    )  # auto encoding: one host, no delta
    out["auto_is_delta"] = isinstance(auto.transport, DeltaTransport)
    delta = WeightSyncService.build(
        trainer,
        rollout,
        plan=plan,
        bucket_bytes=BUCKET,
        transport="torch",
        encoding="delta",
        full_every=4,
    )
    plain = WeightSyncService.build(
        trainer, reference, plan=plan, bucket_bytes=BUCKET, transport="torch", encoding="full"
    )
    out["buckets"] = len(delta.buckets)
    out["wire_full"] = plain.sync(1).wire_bytes  # the same every version
    out["versions"] = {}
    saved = {}

    def sync(version: int, *, streaming: bool = False) -> dict:
        for _ in range(version - sync.last):  # version skips: several steps
            master.step()
        sync.last = version
        if rank == 0:
            full = master.bf16()
            for s in specs:
                trainer.tensors[s.local_name].copy_(cut(s, full))
        if streaming and rank == 0:
            delta.transfer(delta.pack(version), version)
            stats = attrs.evolve(WeightSyncStats(version=version), **delta.transport.counters)
        elif streaming:
            stats = delta.apply(delta.transfer(None, version))
        else:
            stats = delta.sync(version)
        row = {}
        if stats is not None:
            row.update(
                wire=stats.wire_bytes,
                changed=stats.changed_elements,
                compared=stats.compared_elements,
                full_sends=stats.full_sends,
            )
        if rank == 1:
            expected = {s.local_name: cut(s, master.bf16()) for s in rollout.specs}
            row["mismatch"] = _same(_bits(rollout.params), _bits(expected))
        out["versions"][version] = row
        return row

    sync.last = 1
    for version in (1, 2, 3, 5):
        sync(version)
    if rank == 1:  # the receiver will restart from its copy of version 5
        saved = {
            k: _Copy(buffer=c.buffer.clone(), tag=c.tag) for k, c in delta.transport.held.items()
        }
    sync(6, streaming=True)  # the periodic anchor (full_every=4): whole
    if rank == 1:
        delta.transport.held.update(saved)
    sync(7)  # every route resends whole
    sync(8)
    if rank == 1:  # silent corruption of the last bucket's copy, version tag kept
        last = max(key for key in delta.transport.held)
        delta.transport.held[last].buffer.bitwise_xor_(1)
    try:
        sync(9)
    except ShardError as exc:
        out["checksum_error"] = str(exc)
    sync(10)  # the corrupted route resends whole
    plain.sync(10)
    if rank == 1:  # bit-identical to a full sync of the same weights
        out["final_mismatch"] = _same(_bits(rollout.params), _bits(reference.params))
        out["names"] = sorted(rollout.params)
    return out


def test_delta_sync_ends_bit_identical_to_a_full_sync_and_resends_whole_on_mismatch():
    got = run_gloo(_worker, 2)
    sender, receiver = got[0], got[1]
    assert len(sender["errors"]) == 3, sender["errors"]
    assert "weight_sync.encoding='zip'" in sender["errors"][0]
    assert "torch_broadcast" in sender["errors"][1]
    assert "full_every=-1" in sender["errors"][2]
    assert sender["auto_is_delta"] is False
    assert sender["buckets"] > 2
    versions, wire_full = sender["versions"], sender["wire_full"]
    routes = versions[1]["full_sends"]
    assert routes == sender["buckets"]  # version 1: every route whole
    assert versions[6]["full_sends"] == routes  # streaming, the periodic anchor
    for version in (2, 3, 5, 8):
        row = versions[version]
        assert row["full_sends"] == 0, (version, row)
        assert 0 < row["changed"] < row["compared"] / 2, row
        assert row["wire"] < wire_full / 5, (version, row, wire_full)
    assert versions[7]["full_sends"] == routes  # the receiver's copy was stale
    assert versions[7]["wire"] > wire_full  # whole, plus tags and headers
    assert 0 < versions[10]["full_sends"] < routes  # only the corrupted route
    for version, row in receiver["versions"].items():
        assert row["mismatch"] == [], (version, row)
    assert receiver["final_mismatch"] == []
    error = receiver["checksum_error"]
    assert "checksum mismatch on rank 1" in error and "next sync sends" in error, error
    assert "version 9" in error and any(f"'{name}'" in error for name in receiver["names"])
