"""Routing replay on stock transformers MoE modules (Qwen3-MoE, Mixtral, GPT-OSS)."""

from __future__ import annotations

import pytest
import torch

from peerflow.errors import ConfigError
from peerflow.training.routing_replay import RoutingReplay

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory) -> str:
    from tests.engines.hf.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param,
                            num_experts=4, top_k=2, seed=1)


def _model(path: str, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager", **kwargs)


IDS = torch.tensor([[3, 7, 12, 5, 9, 20, 31, 4], [8, 8, 2, 14, 40, 3, 6, 11]])


def _forward(model, controller, forced=None, record=False):
    with controller.forcing(forced, record=record):
        logits = model(input_ids=IDS, use_cache=False).logits
        recorded = controller.recorded() if record else None
    return logits, recorded


def _random_routes(controller: RoutingReplay, tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, controller.num_layers, controller.num_experts, generator=gen)
    return scores.topk(controller.top_k, dim=-1).indices.to(torch.int16)


def test_replaying_recorded_routes_reproduces_the_forward_bit_exactly(moe_dir):
    model = _model(moe_dir)
    native = model(input_ids=IDS, use_cache=False).logits
    controller = RoutingReplay.attach(model, "r2")
    recorded_logits, routes = _forward(model, controller, record=True)
    assert torch.equal(recorded_logits, native)  # rebinding alone changes nothing
    assert routes.dtype == torch.int16 and routes.shape == (IDS.numel(), 2, 2)
    assert int(routes.min()) >= 0
    replayed, _ = _forward(model, controller, forced=routes)
    assert torch.equal(replayed, native)
    metrics = controller.step_metrics()
    assert metrics["moe/replay_no_overlap"] == 0.0 and metrics["moe/replay_changed"] == 0.0


def test_negative_routes_route_natively(moe_dir):
    model = _model(moe_dir)
    controller = RoutingReplay.attach(model, "r3")
    native, _ = _forward(model, controller)
    forced = torch.full((IDS.numel(), 2, 2), -1, dtype=torch.int16)
    replayed, _ = _forward(model, controller, forced=forced)
    assert torch.equal(replayed, native)
    assert controller.step_metrics()["moe/rows_without_routes"] == 1.0


def test_forced_routes_change_the_output_and_the_router_gets_a_gradient(moe_dir):
    model = _model(moe_dir)
    controller = RoutingReplay.attach(model, "r3")
    native, _ = _forward(model, controller)
    forced = _random_routes(controller, IDS.numel())
    replayed, _ = _forward(model, controller, forced=forced)
    assert not torch.allclose(replayed, native)
    with controller.forcing(forced):
        model(input_ids=IDS, use_cache=False).logits.float().pow(2).mean().backward()
    routers = [p for n, p in model.named_parameters() if n.endswith(("gate.weight",
                                                                     "router.weight"))]
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)
    assert controller.step_metrics()["moe/replay_no_overlap"] > 0.0


def test_activation_checkpointing_recompute_replays_the_same_routes(moe_dir):
    grads = []
    for checkpointing in (False, True):
        model = _model(moe_dir)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        controller = RoutingReplay.attach(model, "r3")
        forced = _random_routes(controller, IDS.numel(), seed=5)
        with controller.forcing(forced):
            loss = model(input_ids=IDS, use_cache=False).logits.float().pow(2).mean()
            loss.backward()  # inside the scope, as the toolkit runs it
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_routes_of_another_shape_are_refused(moe_dir):
    model = _model(moe_dir)
    controller = RoutingReplay.attach(model, "r3")
    with pytest.raises(ValueError, match="layers"):
        _forward(model, controller, forced=torch.zeros(IDS.numel(), 3, 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="forced routes have shape"):
        _forward(model, controller, forced=torch.zeros(5, 2, 2, dtype=torch.int16))


def test_aux_loss_matches_transformers(moe_dir):
    model = _model(moe_dir)
    out = model(input_ids=IDS, use_cache=False, output_router_logits=True)
    controller = RoutingReplay.attach(model, "off")
    with controller.forcing(None):
        model(input_ids=IDS, use_cache=False)
        aux = controller.aux_loss()
    # transformers' causal-LM output carries `aux_loss` unscaled by its coefficient
    torch.testing.assert_close(aux, out.aux_loss.to(aux.dtype))
    metrics = controller.step_metrics()
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/load_violation"] >= 0


def test_dense_model_refuses_replay(tiny_model):
    model = _model(tiny_model)
    assert RoutingReplay.attach(model, "off") is None
    with pytest.raises(ConfigError, match="routing_replay: off"):
        RoutingReplay.attach(model, "r2")
