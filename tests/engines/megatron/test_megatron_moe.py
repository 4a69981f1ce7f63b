"""The megatron adapter on tiny Qwen3-MoE and Mixtral: expert parallelism 2, routing replay.

One two-rank run (`mg_moe_worker.py`) builds Megatron's MoE `GPTModel` from the HF
checkpoint with `ep = 2` (experts split 2 + 2) and with `ep = 1, dp = 2` (Mixtral: ep = 2,
from its `block_sparse_moe` checkpoint names), and checks
against a one-process HF reference: native log-probs equal HF's, replaying the trainer's
own recorded routes (r2 → r3) reproduces them bit for bit, replaying the bf16 rollout's
routes changes them, the r3 train step and its `moe/*` metrics, the weights after the
step synced to an hf rollout engine byte-exact, ep = 2 and ep = 1 agreeing after the
step, and a checkpoint round trip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.fsdp.fsdp_testlib import assemble  # noqa: E402
from tests.helpers.gloo import run_script  # noqa: E402

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("mg_moe_worker.py")
CASES = ("ep2", "dp2")
#: Every case: Qwen3-MoE at ep = 2 and dp = 2, Mixtral at ep = 2.
ALL = (*CASES, "mixtral-ep2")
HF = {"ep2": "hf", "dp2": "hf", "mixtral-ep2": "hf-mixtral"}
#: float32 Megatron vs transformers (other kernels, token order): measured ~1e-5.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from tests.engines.hf.tiny_models import build_tiny_qwen3_moe

    # 4 experts: split 2 + 2 at ep = 2
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("mg-qwen3-moe"), num_experts=4)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    from tests.engines.hf.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("mg-mixtral"), arch="mixtral",
                            num_experts=4, seed=4)


@pytest.fixture(scope="module")
def ranks(model, mixtral, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("mg-moe-run")
    run_script(WORKER, str(out), model, mixtral, timeout=400)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _joined(ranks: list[dict], case: str, key: str) -> torch.Tensor:
    if case == "dp2":  # dp rank 0 then 1
        return torch.cat([ranks[0][case][key], ranks[1][case][key]])
    assert torch.equal(ranks[0][case][key], ranks[1][case][key])  # ep peers: same samples
    return ranks[0][case][key]


@pytest.mark.parametrize("case", ALL)
def test_native_logprobs_equal_hf_and_own_routes_replay_bit_exact(ranks, case):
    native = _joined(ranks, case, "native")
    torch.testing.assert_close(native, ranks[0][HF[case]], atol=LOGPROB_TOL, rtol=0)
    assert torch.equal(_joined(ranks, case, "replayed_own"), native)
    metrics = ranks[0][case]["own_metrics"]
    assert metrics["moe/replay_changed"] == 0.0 and metrics["moe/replay_no_overlap"] == 0.0
    # the bf16 rollout routed some tokens elsewhere: forcing its routes moves log-probs
    assert not torch.equal(_joined(ranks, case, "replayed_rollout"), native)


@pytest.mark.parametrize("case", ALL)
def test_r3_train_step_logs_moe_metrics(ranks, case):
    metrics = ranks[0][case]["metrics"]
    assert metrics == ranks[1][case]["metrics"] or case == "dp2"
    assert 0 < metrics["moe/replay_changed"] < 0.1
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/load_violation"] >= 0
    assert 0 < metrics["moe/rows_without_routes"] < 0.2  # the answers' last tokens
    assert metrics["moe/route_bytes"] > 0


def test_gradient_equals_the_fsdp_trainers_with_a_sampled_pad_token(ranks):
    """The batch holds a sampled pad token, whose zero embedding row transformers keeps
    out of the gradient (`padding_idx`); Megatron's step has the same gradient norm."""
    megatron = ranks[0]["dp2"]["metrics"]["grad_norm"]
    assert megatron == pytest.approx(ranks[0]["dp2"]["fsdp_grad_norm"], rel=1e-5)


def test_ep2_holds_half_the_experts_and_steps_like_ep1(ranks):
    experts = [{n for s, _ in r["ep2"]["exported"] for n in s.names if ".experts." in n}
               for r in ranks]
    assert experts[0].isdisjoint(experts[1])
    assert {n.split(".experts.")[1].split(".")[0] for n in experts[1]} == {"2", "3"}
    ep2, dp2 = (assemble(*zip(*[([s for s, _ in r[c]["exported"]],
                                  [t for _, t in r[c]["exported"]]) for r in ranks]))
                for c in CASES)
    assert ep2.keys() == dp2.keys()
    one, two = (ranks[0][c]["metrics"] for c in CASES)
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-5)
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5)
    for name in ep2:  # the same samples, the same step: ep splits experts, not the math
        torch.testing.assert_close(ep2[name], dp2[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("case", ALL)
def test_weight_sync_to_hf_is_byte_exact(ranks, case):
    def trained(r: dict) -> tuple[list, list]:
        return [s for s, _ in r[case]["exported"]], [t for _, t in r[case]["exported"]]

    megatron = assemble(*zip(*[trained(r) for r in ranks]))
    for r in ranks:  # every hf replica holds the full model
        specs, tensors = zip(*r[case]["hf"])
        live = assemble([[attr_replica0(s) for s in specs]], [list(tensors)])
        assert live.keys() == megatron.keys()
        for name, tensor in live.items():
            assert torch.equal(tensor, megatron[name]), name


def attr_replica0(spec):
    """`spec` as replica 0 (to assemble one hf replica's full copy)."""
    import attrs

    return attrs.evolve(spec, replica=0)


@pytest.mark.parametrize("case", ALL)
def test_checkpoint_round_trip_restores_every_shard(ranks, case):
    for r in ranks:
        assert r[case]["version_loaded"] == 1
        for (spec, saved), (_, loaded) in zip(r[case]["exported"], r[case]["resumed"],
                                              strict=True):
            assert torch.equal(saved, loaded), spec.local_name
