"""The host/device mixes found on the H200 (2026-11-27) and by reading the code, one test each.

Run on the emulated accelerator (see conftest.py). Each test fails on main at 3794ea9 with
CUDA's own error (the note on issue 32 lists them) and passes with the device contract.
The distributed sites (barrier, whiten over a group, all_gather_ragged, the coordinator's
exchange) run in two processes, `dist_sites.py`.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from peerflow.algorithms.advantages import GRPO, RLOO, ReinforcePP, ReinforcePPOptions
from peerflow.algorithms.gae import GAE
from peerflow.algorithms.ragged_ops import group_stats, pad, ragged_like
from peerflow.batch import Batch, RaggedField
from peerflow.training.inputs import PaddedInputs, pad_inputs
from tests.device.dist_sites import SITES, run_sites

PROMPTS = [[3, 4], [5], [6, 7, 8]]
RESPONSES = [[9, 10, 11], [12], [13, 14]]


def _ragged(rows: list[list[float]], dtype: torch.dtype, device: torch.device) -> RaggedField:
    lengths = torch.tensor([len(r) for r in rows], device=device)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device),
                         lengths.cumsum(0)])
    values = torch.tensor([v for r in rows for v in r], dtype=dtype, device=device)
    return RaggedField(values=values, offsets=offsets)


def device_batch(device: torch.device) -> Batch:
    """Three samples in two groups, every tensor built on `device`."""
    logprobs = [[-0.5 - 0.1 * j for j in range(len(r))] for r in RESPONSES]
    return Batch(
        sample_id=torch.arange(3, device=device),
        group_id=torch.tensor([0, 0, 1], device=device),
        weight_version=torch.zeros(3, dtype=torch.int64, device=device),
        fields={
            "prompt_ids": _ragged(PROMPTS, torch.int64, device),
            "response_ids": _ragged(RESPONSES, torch.int64, device),
            "rollout_logprobs": _ragged(logprobs, torch.float32, device),
            "values": _ragged([[0.1 * j for j in range(len(r))] for r in RESPONSES],
                              torch.float32, device),
            "reward": torch.tensor([1.0, 0.0, 0.5], device=device),
        })


def test_ragged_like_builds_offsets_beside_the_lengths(device):
    """H200 run2: `ragged_like` put offsets on the host and `cumsum(out=)` got device lengths."""
    field = ragged_like(torch.ones(6, device=device), torch.tensor([3, 1, 2], device=device))
    assert field.offsets.device == device
    assert field.offsets.tolist() == [0, 3, 4, 6]


def test_current_proximal_loss_scores_on_the_device(device):
    """H200 run3: the on-policy loss path (`CurrentProximal`: `ragged_like` of the current
    log-probs, then `mismatch_metrics` / `token_values`, `importance_weights`) mixed host
    offsets with device lengths."""
    from peerflow.algorithms.losses import PPOClip
    from peerflow.algorithms.off_policy import CurrentProximal
    from peerflow.config.schema import OffPolicyConfig

    batch = device_batch(device)
    lengths = batch.lengths("response_ids")
    batch.set("advantages", ragged_like(torch.ones(6, device=device), lengths))
    current = batch.ragged("rollout_logprobs")
    logprobs = RaggedField(values=current.values.clone().requires_grad_(),
                           offsets=current.offsets)
    loss, metrics = CurrentProximal(PPOClip(), OffPolicyConfig())(
        logprobs, batch, global_tokens=6, global_samples=3)
    loss.backward()
    assert loss.device == device and logprobs.values.grad.device == device
    assert metrics["mismatch/abs_max"] == 0.0


def test_a_batch_refuses_a_field_on_another_device(device):
    """The invariant that keeps the mixes out: one device per batch, the field named."""
    host = device_batch(torch.device("cpu"))
    with pytest.raises(ValueError, match="'reward' is on emu:0 but the batch lives on cpu"):
        host.set("reward", torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="one device"):
        RaggedField(values=torch.ones(2, device=device), offsets=torch.tensor([0, 2]))


def test_batch_select_gathers_on_the_device(device):
    """`Batch.select`: `gather_index` built its arange and offsets on the host."""
    picked = device_batch(device).select([2, 0])
    assert picked.ragged("response_ids").values.tolist() == [13, 14, 9, 10, 11]
    assert picked.ragged("response_ids").offsets.device == device


def test_batch_to_padded_builds_its_mask_on_the_device(device):
    padded, mask = device_batch(device).to_padded("response_ids")
    assert padded.device == device and mask.device == device
    assert padded[0].tolist() == [9, 10, 11]


def test_batch_token_count_counts_on_the_device(device):
    assert device_batch(device).token_count().tolist() == [5, 2, 5]


def test_group_stats_reduce_on_the_device(device):
    count, mean, std = group_stats(torch.tensor([1.0, 0.0, 0.5], device=device),
                                   torch.tensor([0, 0, 1], device=device))
    assert count.device == device
    assert mean.tolist() == [0.5, 0.5, 0.5]


def test_pad_builds_its_mask_on_the_device(device):
    padded, mask = pad(torch.arange(6.0, device=device), torch.tensor([3, 1, 2], device=device))
    assert mask.device == device and padded[2].tolist() == [4.0, 5.0, 0.0]


ESTIMATORS = {
    "grpo": lambda: GRPO(),
    "rloo": lambda: RLOO(),
    "reinforce_pp": lambda: ReinforcePP(),
    "reinforce_pp_baseline": lambda: ReinforcePP(ReinforcePPOptions(group_baseline=True)),
    "gae": lambda: GAE(),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_advantage_estimators_compute_on_the_device(device, name):
    """`advantages.py` and `gae.py`: per-token rewards, discounted returns and the GAE
    recursion started on the host; every estimator now matches its CPU result."""
    estimator = ESTIMATORS[name]()
    on_device = estimator.compute(device_batch(device))
    on_host = estimator.compute(device_batch(torch.device("cpu")))
    for key, field in on_device.items():
        assert field.values.device == device, key
        torch.testing.assert_close(field.values.cpu(), on_host[key].values)


def test_padded_inputs_response_mask_on_the_device(device):
    """`training/inputs.py`: `response_mask` built its positions on the host."""
    host = pad_inputs(Batch(sample_id=torch.arange(2), group_id=torch.arange(2),
                            weight_version=torch.zeros(2, dtype=torch.int64), fields={
                                "prompt_ids": _ragged(PROMPTS[:2], torch.int64, "cpu"),
                                "response_ids": _ragged(RESPONSES[:2], torch.int64, "cpu")}))
    fields = attrs.asdict(host, recurse=False)
    inputs = PaddedInputs(**{name: value.to(device) if isinstance(value, torch.Tensor)
                             else value for name, value in fields.items()})
    logits = torch.zeros(*inputs.input_ids.shape, 4, device=device)
    assert inputs.response_mask().device == device
    assert inputs.gather(logits).values.shape == (4, 4)


def test_a_micro_batch_crosses_to_the_device_whole(device, tiny_model):
    """`collectives.batch_to` left ids on the host: now the ids, every field with its
    offsets, and the model inputs cross together."""
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.engines import EngineContext, OptimSettings
    from peerflow.layout import ParallelLayout

    engine = FSDPTrainEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout(),
                                           device=str(device)), None, OptimSettings())
    host = device_batch(torch.device("cpu"))
    micro = engine.build_micro_batch(host, [0, 2], True, pad_inputs)
    tensors = [micro.batch.sample_id, micro.batch.group_id, micro.batch.weight_version,
               micro.inputs.input_ids, micro.inputs.response_lengths]
    for column in micro.batch.fields.values():
        tensors += [column.values, column.offsets] if isinstance(column, RaggedField) \
            else [column]
    assert {t.device for t in tensors} == {device}


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared", "own-rows"])
def test_padding_free_step_on_the_device_equals_the_padded_one(device, tiny_model,
                                                               share_prompts):
    """Padding-free micro-batches: the packed row, its position ids and (shared prompts)
    its mask cross with the micro-batch; the step equals the padded one."""
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.engines import EngineContext
    from peerflow.layout import ParallelLayout
    from tests.engines.fsdp.test_padding_free import TEMPERATURE, make_batch, one_step, optim

    context = EngineContext(model_path=tiny_model, layout=ParallelLayout(),
                            device=str(device), temperature=TEMPERATURE)
    steps = []
    for padding_free in (False, True):
        engine = FSDPTrainEngine(context, FSDPTrainOptions(share_prompts=share_prompts),
                                 optim(padding_free))
        batch = make_batch(engine.model.config.vocab_size)
        micro = engine.plan_micro_batches(batch)[0]
        inputs = [micro.inputs.input_ids, micro.inputs.position_ids, micro.batch.sample_id]
        assert {t.device for t in inputs} == {device}
        step = one_step(engine, batch)
        assert step["logprobs"].device.type == "cpu"  # gathered back to the host
        steps.append(step)
    padded, packed = steps
    torch.testing.assert_close(packed["logprobs"], padded["logprobs"], atol=2e-5, rtol=1e-5)
    for key in ("loss", "grad_norm"):
        assert packed["metrics"][key] == pytest.approx(padded["metrics"][key], rel=1e-4)


@pytest.fixture(scope="module")
def distributed_sites() -> dict[str, str | None]:
    return run_sites()


@pytest.mark.parametrize("site", SITES)
def test_distributed_site(device, distributed_sites, site):
    """barrier (H200 run1), whiten over the role group, all_gather_ragged on an NCCL-only
    group, the coordinator's exchange of host bytes over the default group."""
    assert distributed_sites[site] is None, distributed_sites[site]


def test_integer_histc_counts_as_cuda_does(device):
    """transformers' grouped-MoE path counts expert ids with an integer `histc` off the
    CPU (CUDA takes integers; the CPU kernel only floats)."""
    ids = torch.tensor([0, 2, 2, 3, 1, 2], device=device, dtype=torch.int32)
    counts = torch.histc(ids, bins=4, min=0, max=3)
    assert counts.device == ids.device and counts.dtype == torch.int32
    assert counts.cpu().tolist() == [1, 1, 3, 1]


def test_delta_codec_runs_on_the_device(device):
    """Delta weight sync diffs, encodes (indices and bitmap), applies and checksums a
    shard's bytes where they live, with no host copy."""
    from peerflow.reshard.delta_codec import apply_delta, encode_delta, region_checksum

    g = torch.Generator().manual_seed(0)
    for share in (0.01, 0.2):  # indices, then a bitmap
        old = torch.randn(20_000, generator=g).to(torch.bfloat16)
        new = old.clone()
        picked = torch.randperm(old.numel(), generator=g)[: int(share * old.numel())]
        new[picked] = torch.randn(picked.numel(), generator=g).to(torch.bfloat16)
        a, b = new.view(torch.uint8).to(device), old.view(torch.uint8).to(device)
        payload, changed, _ = encode_delta(a, b, 2)
        assert payload is not None and payload.device.type == device.type
        base = b.clone()
        apply_delta(base, payload, changed, 2)
        assert torch.equal(base.cpu(), a.cpu())
        assert torch.equal(region_checksum(a).cpu(), region_checksum(a.cpu()))
