"""The megatron adapter's hook in megatron-core's `RouterReplay` (one process, no model).

Megatron's routers see tokens sequence-major (`[S, B]` flattened), the controller's routes
are batch-major (`input_ids` `[B, S]` flattened); a -1 route keeps the native top-k.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

ROWS, WIDTH, EXPERTS, TOP_K = 2, 3, 4, 2


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)  # Megatron's default_compute_topk without groups


def _hook(mode: str):
    from peerflow.adapters.megatron.routing import TokenOrder, controlled_replay_class
    from peerflow.training.routing_replay import RoutingReplay

    controller = RoutingReplay.hooked(mode, num_layers=1, top_k=TOP_K, num_experts=EXPERTS,
                                      sparse_layers=(0,))
    order = TokenOrder(rows=ROWS, width=WIDTH)
    return controller, order, controlled_replay_class()(controller, 0, order, False)


def test_token_order_round_trips():
    from peerflow.adapters.megatron.routing import TokenOrder

    order = TokenOrder(rows=ROWS, width=WIDTH)
    batch_major = torch.arange(ROWS * WIDTH * 5).reshape(ROWS * WIDTH, 5)
    megatron = order.to_megatron(batch_major)
    assert torch.equal(megatron[1], batch_major[WIDTH])  # s=0, b=1 is input_ids[1, 0]
    assert torch.equal(order.to_batch(megatron), batch_major)


def test_forced_routes_replay_per_token_and_keep_the_router_gradient():
    controller, order, hook = _hook("r3")
    logits = torch.randn(ROWS * WIDTH, EXPERTS, generator=torch.Generator().manual_seed(0),
                         requires_grad=True)
    forced = torch.tensor([[3, 0], [2, 1], [-1, -1], [0, 1], [1, 3], [-1, 2]])  # batch order
    with controller.forcing(forced[:, None].to(torch.int16)):
        probs, indices = hook.get_replay_topk(logits, TOP_K, default_compute_topk=_topk)
    native = order.to_batch(_topk(logits, TOP_K)[1])
    want = torch.where((forced >= 0).all(-1, keepdim=True), forced, native)
    assert torch.equal(order.to_batch(indices), want)  # -1 rows (any slot) route natively
    assert torch.equal(probs, logits.gather(1, indices))  # the live router's scores
    probs.sum().backward()
    assert logits.grad.abs().sum() > 0
    metrics = controller.step_metrics()
    assert metrics["moe/rows_without_routes"] == pytest.approx(2 / 6)


def test_r2_records_native_routes_in_batch_order():
    controller, order, hook = _hook("r2")
    logits = torch.randn(ROWS * WIDTH, EXPERTS, generator=torch.Generator().manual_seed(1))
    with controller.forcing(None, record=True):
        _, indices = hook.get_replay_topk(logits, TOP_K, default_compute_topk=_topk)
    assert torch.equal(controller.recorded()[:, 0].long(), order.to_batch(indices))
