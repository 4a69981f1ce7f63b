"""megatron-core 0.16.1's MoE runs at expert parallelism 2 over gloo on the CPU.

What a Megatron MoE adapter would stand on (the adapter itself builds dense models and
refuses `routing_replay` and `ep > 1`, docs/moe.md): the allgather token dispatcher,
`SequentialMLP` experts split 2 + 2 over the ep ranks, forward and backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.gloo import run_script

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed


def test_ep2_allgather_dispatcher_runs_forward_and_backward_on_cpu(tmp_path):
    run_script(Path(__file__).with_name("mg_moe_ep_worker.py"), str(tmp_path), nprocs=2,
               timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in ranks:
        assert result["shape"] == (2, 8, 64)
        assert result["router_grad"] > 0
        # each ep rank holds 2 of the 4 experts of every layer (local indices 0 and 1)
        local = {n.split("local_experts.")[1].split(".")[0] for n in result["experts"]}
        assert local == {"0", "1"}
