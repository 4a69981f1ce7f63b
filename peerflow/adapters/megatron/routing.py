"""Megatron's MoE routers under the training toolkit's one routing-replay controller.

megatron-core 0.16.1 builds every `TopKRouter` with a `RouterReplay` object when
`moe_enable_routing_replay` is set (`model.py` sets it for MoE models), and its top-k
goes through `RouterReplay.get_replay_topk(scores, topk, …, default_compute_topk)`. That
native hook is where PeerFlow's controller (`peerflow.training.routing_replay`) plugs in:
`ControlledReplay` replaces each router's `RouterReplay` and

* computes the native top-k with Megatron's own function (`default_compute_topk`);
* reports the router logits, the native top-k and the forced routes to the controller
  (`observe`: aux loss, `moe/replay_*` metrics, r2 recording);
* replays the controller's routes for the open micro-batch (`forced_routes`): Megatron's
  own `REPLAY_FORWARD` gathers the scores at the target indices — so the gate weights
  come from the live router and it keeps its gradient — and so does this class, but per
  token: a token whose route is -1 (padding, the last sampled token) keeps its native
  top-k, where Megatron's action would need a route for every token.

Megatron's tokens run sequence-major (`[S, B]` flattened), PeerFlow's routes batch-major
(`input_ids` `[B, S]` flattened); `TokenOrder` (set by the engine before each forward)
converts between them. Activation recompute is not wired in the megatron trainer (refused
at `config validate`), so there is no backward replay (`REPLAY_BACKWARD`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from peerflow.training.routing_replay import RoutingReplay


@attrs.define
class TokenOrder:
    """The `[B, S]` shape of the micro-batch being forwarded (set by the engine)."""

    rows: int = 0
    width: int = 0

    def to_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[S * B, …]` (Megatron's order) to `[B * S, …]` (`input_ids` flattened)."""
        tail = tensor.shape[1:]
        return tensor.reshape(self.width, self.rows, *tail).transpose(0, 1).reshape(-1, *tail)

    def to_megatron(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[B * S, …]` to `[S * B, …]`."""
        tail = tensor.shape[1:]
        return tensor.reshape(self.rows, self.width, *tail).transpose(0, 1).reshape(-1, *tail)


def controlled_replay_class() -> type:
    """`ControlledReplay`: megatron-core's `RouterReplay` driven by the controller.

    Built on call, so megatron-core is imported only when the engine is.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class ControlledReplay(RouterReplay):
        """One router's `RouterReplay`, driven by PeerFlow's controller (see module doc)."""

        def __init__(self, controller: RoutingReplay, layer: int, order: TokenOrder,
                     pre_softmax: bool) -> None:
            super().__init__()
            self.controller, self.layer, self.order = controller, layer, order
            self.pre_softmax = pre_softmax

        def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Any = None,
                            group_topk: Any = None,
                            default_compute_topk: Callable | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
            _, native = default_compute_topk(scores, topk, num_groups=num_groups,
                                             group_topk=group_topk)
            forced = self.controller.forced_routes(self.layer)
            # scores are the logits, or their softmax with moe_router_pre_softmax (whose log
            # has the same softmax): what the controller's aux loss takes
            logits = scores.log() if self.pre_softmax else scores
            order = self.order
            self.controller.observe(self.layer, order.to_batch(logits), order.to_batch(native),
                                    forced)
            indices = native
            if forced is not None:
                forced = order.to_megatron(forced.to(scores.device)).long()
                indices = torch.where((forced >= 0).all(-1, keepdim=True), forced, native)
            return scores.gather(1, indices), indices

    return ControlledReplay


def hook_routers(module: torch.nn.Module, controller: RoutingReplay, order: TokenOrder,
                 config: Any) -> int:
    """Puts every `TopKRouter` of `module` under `controller`; returns how many.

    Each router's layer is its global decoder layer (`layer_number - 1`). Megatron's own
    `RouterReplay` objects of these routers leave its global instance list.
    """
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    cls = controlled_replay_class()
    hooked = 0
    for router in module.modules():
        if not isinstance(router, TopKRouter) or router.router_replay is None:
            continue
        old = router.router_replay
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if r is not old]
        router.router_replay = cls(controller, int(router.layer_number) - 1, order,
                                   bool(config.moe_router_pre_softmax))
        hooked += 1
    return hooked


def release_routers(module: torch.nn.Module) -> None:
    """Drops this model's replay objects from Megatron's global instance list (shutdown)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine = {id(m.router_replay) for m in module.modules()
            if getattr(m, "router_replay", None) is not None}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
