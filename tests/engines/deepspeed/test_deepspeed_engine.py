"""DeepSpeed train engine: ZeRO 1/2/3 on two gloo ranks against a one-process HF reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.deepspeed.trainlib import (  # noqa: E402
    SCHEDULE_LRS,
    assert_step_matches,
    export_checkpoint,
    full_batch,
    hf_logprobs,
    reference,
)

pytest.importorskip("deepspeed")
WORKER = Path(__file__).with_name("ds_worker.py")
STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def ref(tiny) -> dict:
    return reference(tiny)


def test_options_validate_before_deepspeed_runs():
    from peerflow.adapters.deepspeed.options import DeepSpeedOptions
    from peerflow.engines import OptimSettings
    from peerflow.errors import ConfigError

    with pytest.raises(ConfigError, match="zero_stage=4"):
        DeepSpeedOptions(zero_stage=4)
    with pytest.raises(ConfigError, match="gradient_clipping"):
        DeepSpeedOptions(config={"gradient_clipping": 2.0})
    with pytest.raises(ConfigError, match="zero_stage instead"):
        DeepSpeedOptions(config={"zero_optimization": {"stage": 3}})
    merged = DeepSpeedOptions(zero_stage=3, config={
        "zero_optimization": {"reduce_bucket_size": 1000}, "comms_logger": {"enabled": False},
    }).deepspeed_config(OptimSettings(grad_clip=0.5), bf16=False)
    assert merged["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1000}
    assert merged["gradient_clipping"] == 0.5
    assert merged["comms_logger"] == {"enabled": False}


def test_registered_with_requirements(plugin_manager):
    cls = plugin_manager.registry("train_engine").get("deepspeed")
    assert cls.requires == ("deepspeed",)
    assert cls.missing_requirements() == ()
    assert cls.capabilities.checkpoint


def test_micro_batches_respect_token_budget():
    from peerflow.training import pack_by_tokens, pad_inputs

    lengths = [5, 3, 9, 2, 2, 2]
    groups = pack_by_tokens(lengths, budget=10)
    assert groups[0] == [2]  # the longest alone: two of them would pass the budget
    assert sum(max(lengths[i] for i in g) * len(g) for g in groups) < 10 * 3  # 9+5+3+6
    assert all(max(lengths[i] for i in g) * len(g) <= 10 for g in groups)
    assert sorted(i for g in groups for i in g) == list(range(6))
    inputs = pad_inputs(full_batch())
    mask = inputs.response_mask()
    assert int(mask.sum()) == int(full_batch().lengths("response_ids").sum())


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_logprobs_match_hf(ranks, ref, stage):
    # a group's answers share one row (one prompt run); the reference runs each alone
    assert all(rank[stage]["shares_prompts"] for rank in ranks)
    got = torch.cat([ranks[0][stage]["logprobs"], ranks[1][stage]["logprobs"]])
    diff = (got - ref["logprobs"]).abs().max().item()
    assert diff < 1e-5, f"ZeRO-{stage} log-probs differ from HF by {diff}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_train_step_matches_one_process_reference(ranks, ref, stage):
    for rank in ranks:
        assert_step_matches(rank[stage]["metrics"], ref)
    owned = {**ranks[0][stage]["after_one"], **ranks[1][stage]["after_one"]}
    assert set(owned) == set(ref["state"]), "every HF tensor has exactly one sending owner"
    for name, tensor in owned.items():
        torch.testing.assert_close(tensor, ref["state"][name], atol=2e-5, rtol=0,
                                   msg=f"ZeRO-{stage} {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_export_spreads_owners_and_names_full_tensors(ranks, ref, stage):
    specs = [r[stage]["specs"] for r in ranks]
    assert [s.local_name for s in specs[0]] == [s.local_name for s in specs[1]]
    for a, b in zip(*specs):
        assert sorted((a.replica, b.replica)) == [0, 1]
        assert a.local_shape == tuple(ref["state"][a.local_name].shape)
    sent = [sum(s.numel for s in r if s.replica == 0) for r in specs]
    assert min(sent) > 0.3 * sum(sent), f"owners unbalanced: {sent}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_resume_is_exact(ranks, stage):
    for rank in ranks:
        result = rank[stage]
        assert result["version_loaded"] == 1
        assert set(result["resumed"]) == set(result["after_two"])
        for name, tensor in result["after_two"].items():
            torch.testing.assert_close(result["resumed"][name], tensor, atol=0, rtol=0)
        assert any(not torch.equal(t, result["after_one"][n])
                   for n, t in result["after_two"].items()), "step 2 changed nothing"
        assert result["lrs"] == pytest.approx(SCHEDULE_LRS, rel=1e-12)  # schedule resumed


@pytest.mark.distributed
def test_checkpoint_of_a_smaller_model_is_refused(ranks):
    for rank in ranks:
        message = rank["smaller_refused"]
        assert message is not None and "not in the model: model.layers.1." in message


@pytest.mark.distributed
def test_native_config_is_validated_by_deepspeed(ranks):
    message = ranks[0]["bad_passthrough"]
    assert message is not None and "not_a_deepspeed_key" in message


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_exported_checkpoint_loads_in_transformers_with_the_trainers_logprobs(
        ranks, run_dir, tiny, tmp_path, stage):
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine

    out = export_checkpoint(DeepSpeedTrainEngine, str(run_dir / f"ckpt{stage}"), tiny,
                            str(tmp_path / "model"))
    trainer = torch.cat([ranks[0][stage]["logprobs_one"], ranks[1][stage]["logprobs_one"]])
    diff = (hf_logprobs(out, full_batch()) - trainer).abs().max().item()
    assert diff < 1e-5, f"ZeRO-{stage} export: log-probs differ from the trainer's by {diff}"
    from safetensors.torch import load_file

    saved = load_file(str(Path(out) / "model.safetensors"))
    owned = {**ranks[0][stage]["after_one"], **ranks[1][stage]["after_one"]}
    assert set(saved) == set(owned), "tied lm_head written once, under the embedding's name"
    for name, tensor in owned.items():
        torch.testing.assert_close(saved[name], tensor, atol=0, rtol=0, msg=name)


@pytest.mark.distributed
def test_crafted_pickle_in_the_checkpoint_is_refused_by_name_and_never_runs(
        ranks, run_dir, tiny, tmp_path, monkeypatch):
    """Resume/eval (`load_checkpoint`, both ranks) and export (`saved_shards`, whose
    `zero_to_fp32` unpickles unrestricted) refuse the copy of the ZeRO-2 checkpoint whose
    rank-1 optimiser file holds a `touch MARKER` payload; the full run-directory version
    is tests/engines/hostile/test_hostile_checkpoints.py (slow)."""
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine
    from peerflow.checkpoint.pickles import TRUST_ENV, UntrustedCheckpointError

    monkeypatch.setenv(TRUST_ENV, "0")
    crafted = ranks[0]["crafted"]
    for rank in ranks:
        refusal = rank["crafted"]["refusal"]
        assert refusal is not None and crafted["target"] in refusal
        assert "--trust-checkpoint" in refusal and not rank["crafted"]["ran"]
    with pytest.raises(UntrustedCheckpointError, match="rank_1_mp_rank_00_optim_states.pt"):
        export_checkpoint(DeepSpeedTrainEngine, crafted["path"], tiny, str(tmp_path / "m"))
    assert not list(run_dir.glob("*-pwned")), "the payload ran"
