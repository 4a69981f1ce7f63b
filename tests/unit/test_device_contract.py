"""The device contract without a device: where it is decided, and the rules the code keeps.

`tests/device/` runs the same code on the emulated accelerator; these tests pin the
decisions (devices, group backends, the Batch invariant) and the code rules on the CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from peerflow.batch import Batch, RaggedField, offsets_from_lengths
from peerflow.distributed import devices
from peerflow.training.inputs import gather_results

ROOT = Path(__file__).resolve().parents[2] / "peerflow"


@pytest.fixture
def gpus(monkeypatch):
    """A host with `count` CUDA devices, as `torch.accelerator` reports it."""

    def have(count: int, local_world: int) -> None:
        monkeypatch.setattr(devices, "accelerator_type", lambda: "cuda")
        monkeypatch.setattr(devices, "device_count", lambda: count)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))

    return have


def test_a_cpu_rank_computes_on_the_host_over_gloo(monkeypatch):
    monkeypatch.setattr(devices, "accelerator_type", lambda: None)
    assert devices.rank_device(3) == torch.device("cpu")
    assert devices.group_backend() == "gloo"


def test_a_gpu_rank_carries_host_tensors_over_gloo_and_device_tensors_over_nccl(gpus):
    gpus(count=8, local_world=8)
    assert devices.rank_device(5) == torch.device("cuda", 5)
    assert not devices.ranks_share_devices()
    assert devices.group_backend(torch.device("cuda", 5)) == "cpu:gloo,cuda:nccl"


def test_ranks_sharing_a_gpu_carry_device_tensors_over_gloo(gpus):
    """NCCL refuses two ranks on one GPU: two ranks on one device use gloo for both."""
    gpus(count=1, local_world=2)
    assert devices.rank_device(1) == torch.device("cuda", 0)
    assert devices.ranks_share_devices()
    assert devices.group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:gloo"


def test_a_batch_lives_on_one_device_and_names_the_field_that_does_not():
    meta = torch.device("meta")  # any second device shows the invariant
    batch = Batch(sample_id=torch.arange(2), group_id=torch.arange(2),
                  weight_version=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="'reward' is on meta but the batch lives on cpu"):
        batch.set("reward", torch.zeros(2, device=meta))
    with pytest.raises(ValueError, match="'group_id' is on meta"):
        Batch(sample_id=torch.arange(2), group_id=torch.arange(2, device=meta),
              weight_version=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="one device"):
        RaggedField(values=torch.zeros(3, device=meta), offsets=torch.tensor([0, 3]))


def test_batches_travel_from_the_host_only():
    batch = Batch(sample_id=torch.arange(2, device="meta"),
                  group_id=torch.arange(2, device="meta"),
                  weight_version=torch.zeros(2, dtype=torch.int64, device="meta"))
    assert batch.device == torch.device("meta")
    with pytest.raises(ValueError, match="travel between processes from the host"):
        batch.to_wire()
    with pytest.raises(ValueError, match="cannot gather batches"):
        Batch.concat([batch, Batch(sample_id=torch.arange(2), group_id=torch.arange(2),
                                   weight_version=torch.zeros(2, dtype=torch.int64))])


def test_offsets_come_from_one_helper():
    assert offsets_from_lengths([]).tolist() == [0]
    assert offsets_from_lengths(torch.tensor([2, 0, 3])).tolist() == [0, 2, 2, 5]


def test_results_come_back_in_batch_order_in_one_field():
    parts = [([2, 0], RaggedField.from_tensors([torch.tensor([5.0]), torch.tensor([1.0, 2.0])])),
             ([1], RaggedField.from_tensors([torch.tensor([3.0, 4.0])]))]
    field = gather_results(3, parts)
    assert [r.tolist() for r in field.rows()] == [[1.0, 2.0], [3.0, 4.0], [5.0]]
    with pytest.raises(KeyError, match=r"samples \[3\]"):
        gather_results(4, parts)


def _calls(pattern: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for path in ROOT.rglob("*.py"):
        rel = str(path.relative_to(ROOT.parent))
        count = len(re.findall(pattern, path.read_text()))
        if count and not rel.startswith("peerflow/testing/"):
            found[rel] = count
    return found


def test_process_groups_are_made_in_one_place():
    assert set(_calls(r"dist\.new_group\(")) == {"peerflow/distributed/groups.py"}
    # the default group: the worker's, and standalone engines' (conformance, megatron
    # alone) with the contract's backends; the coordinator benchmark measures the host
    assert set(_calls(r"init_process_group\(")) == {
        "peerflow/distributed/init.py", "peerflow/adapters/megatron/parallel.py",
        "peerflow/conformance/engines.py", "peerflow/bench/coordinator.py"}


def test_the_core_asks_the_device_contract_not_cuda():
    core = ("batch.py", "ragged.py", "algorithms/", "training/", "worker/", "coordinator/",
            "streaming/", "distributed/", "checkpoint/", "agents/")
    users = {path for path in _calls(r"torch\.cuda\.") if path.removeprefix("peerflow/")
             .startswith(core)}
    assert not users, f"decide devices in peerflow/distributed/devices.py, not in {users}"


def test_ranks_sharing_a_gpu_sync_weights_over_cuda_ipc(monkeypatch, gpus):
    """NCCL cannot join two ranks on one GPU; `auto` moves their buckets over CUDA IPC."""
    from types import SimpleNamespace

    from peerflow.reshard.service import auto_transport
    from peerflow.reshard.transports import CudaIpcTransport, TorchP2PTransport

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = SimpleNamespace(transfers=[SimpleNamespace(src_rank=0, dst_rank=1)])
    gpus(count=1, local_world=2)
    assert isinstance(auto_transport(plan, rank=0, group=None, device="cuda:0"),
                      CudaIpcTransport)
    gpus(count=2, local_world=2)
    assert isinstance(auto_transport(plan, rank=0, group=None, device="cuda:0"),
                      TorchP2PTransport)


@pytest.mark.parametrize("returns", ["fields", "batch"])
def test_a_node_that_hands_back_device_tensors_is_named(returns):
    """Everything the worker touches lives on the host: a node's output off it is refused,
    naming the node (and the field)."""
    from types import SimpleNamespace

    from peerflow.worker.nodes import run_node

    class LeakyNode:
        def __init__(self, node, config) -> None:
            pass

        def run(self, batch, context):
            if returns == "batch":
                return Batch(sample_id=batch.sample_id.to("meta"),
                             group_id=batch.group_id.to("meta"),
                             weight_version=batch.weight_version.to("meta"))
            return {"score": torch.zeros(len(batch), device="meta")}

    rt = SimpleNamespace(pm=SimpleNamespace(get=lambda kind, name: LeakyNode), config=None,
                         node_context=lambda node, metrics: None)
    node = SimpleNamespace(name="judge", kind="my_scorer")
    batch = Batch(sample_id=torch.arange(2), group_id=torch.arange(2),
                  weight_version=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="workflow node 'judge' .*(meta|'score')"):
        run_node(rt, node, batch, metrics=None)
