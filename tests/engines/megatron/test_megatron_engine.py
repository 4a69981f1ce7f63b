"""Megatron-core engine on two gloo ranks: dp2, tp2, pp2 for Llama, Qwen2 and Qwen3.

Every case is checked against a one-process HF reference: log-probs from the
vocab-parallel logits (and, for Llama, the `fsdp` trainer's log-probs on the same
weights), the gradient norm of one step, and the exported shards after that step, piece
by piece (interleaved QKV per query group, fused gate/up, padded vocab rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.deepspeed.trainlib import (  # noqa: E402
    SCHEDULE_LRS,
    assert_step_matches,
    build_model,
    dumps,
    export_checkpoint,
    full_batch,
    hf_logprobs,
    reference,
)
from tests.helpers.gloo import run_script  # noqa: E402

pytest.importorskip("megatron.core")
WORKER = Path(__file__).with_name("mg_worker.py")
#: Measured max |Megatron - HF| log-prob difference here is ~5e-7 (float32).
LOGPROB_TOL = 1e-5
#: name, family, tp, pp (dp fills the 2 ranks).
CASES = [
    ("llama-dp2-fsdp", "llama", 1, 1),
    ("llama-tp2", "llama", 2, 1),
    ("llama-pp2", "llama", 1, 2),
    ("qwen2-tp2", "qwen2", 2, 1),
    ("qwen2-pp2", "qwen2", 1, 2),
    ("qwen3-tp2", "qwen3", 2, 1),
]
FAMILIES = {"llama": True, "qwen2": False, "qwen3": False}  # family -> tied embeddings


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return {f: build_model(tmp_path_factory.mktemp(f"mg-{f}"), f, tied=tied)
            for f, tied in FAMILIES.items()}


@pytest.fixture(scope="module")
def refs(models) -> dict[str, dict]:
    return {f: reference(path) for f, path in models.items()}


@pytest.fixture(scope="module")
def run_dir(models, tmp_path_factory) -> Path:
    """The workers' output: `rank{R}.pt` and the checkpoints `ckpt-{case}` (after one step)."""
    out = tmp_path_factory.mktemp("mg-run")
    cases = [[name, fam, models[fam], tp, pp] for name, fam, tp, pp in CASES]
    run_script(WORKER, str(out), dumps(cases), timeout=540)
    return out


@pytest.fixture(scope="module")
def ranks(run_dir) -> list[dict]:
    return [torch.load(run_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _case(name: str) -> tuple[str, int, int]:
    _, family, tp, pp = next(c for c in CASES if c[0] == name)
    return family, tp, pp


def _logprobs(ranks: list[dict], name: str, key: str = "logprobs") -> torch.Tensor:
    if ranks[0][name]["dp"] == 2:
        return torch.cat([ranks[0][name][key], ranks[1][name][key]])
    torch.testing.assert_close(ranks[0][name][key], ranks[1][name][key], atol=0, rtol=0)
    return ranks[0][name][key]


def test_registered_with_requirements(plugin_manager):
    cls = plugin_manager.registry("train_engine").get("megatron")
    assert cls.requires == ("megatron.core",)
    assert cls.missing_requirements() == ()
    assert cls.capabilities.tensor_parallel and cls.capabilities.pipeline_parallel


def test_unsupported_models_and_cpu_distributed_optimizer_are_rejected(models):
    from transformers import AutoConfig

    from peerflow.adapters.megatron.model import check_supported
    from peerflow.adapters.megatron.options import MegatronOptions
    from peerflow.errors import ConfigError

    config = AutoConfig.from_pretrained(models["llama"])
    config.rope_scaling = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ConfigError, match="yarn"):
        check_supported(config)
    with pytest.raises(ValueError, match="'vocab_multiple' must be >= 1: 0"):
        MegatronOptions(vocab_multiple=0)


def test_cpu_redirect_is_confined_to_megatron_modules():
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rope

    from peerflow.adapters.megatron.cpu import enable_redirects

    enable_redirects()
    assert rope.torch.cuda.current_device() == torch.device("cpu")
    assert rope.torch.zeros(2, device="cuda").device.type == "cpu"
    assert not torch.cuda.is_available()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()  # PeerFlow's own torch is untouched


@pytest.mark.distributed
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_logprobs_match_hf(ranks, refs, name):
    family, _, _ = _case(name)
    diff = (_logprobs(ranks, name) - refs[family]["logprobs"]).abs().max().item()
    assert diff < LOGPROB_TOL, f"{name}: max |megatron - hf| = {diff}"


@pytest.mark.distributed
def test_logprobs_match_fsdp_trainer(ranks):
    name = "llama-dp2-fsdp"
    diff = (_logprobs(ranks, name) - _logprobs(ranks, name, "fsdp_logprobs")).abs().max()
    assert diff.item() < LOGPROB_TOL, f"max |megatron - fsdp| = {diff.item()}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_step_and_exported_shards_match_reference(ranks, refs, name):
    family, tp, pp = _case(name)
    ref = refs[family]
    covered = {n: torch.zeros(t.shape, dtype=torch.int64) for n, t in ref["state"].items()}
    for rank in ranks:
        assert_step_matches(rank[name]["metrics"], ref)
        for spec, tensor in rank[name]["exported"]:
            assert tuple(tensor.shape) == spec.local_shape
            for box in spec.padding:
                assert not tensor[box.slices()].any(), f"{spec.local_name} padding not zero"
            for piece in spec.pieces:
                expected = ref["state"][piece.name][piece.global_box.slices()]
                torch.testing.assert_close(tensor[piece.local_box.slices()], expected,
                                           atol=2e-5, rtol=0, msg=f"{name} {spec.local_name}")
                if spec.replica == 0:
                    covered[piece.name][piece.global_box.slices()] += 1
    for hf_name, count in covered.items():
        assert bool((count == 1).all()), f"{name}: {hf_name} not sent exactly once"


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama-tp2", "llama-pp2", "llama-dp2-fsdp"])
def test_checkpoint_resume_is_exact(ranks, name):
    for rank in ranks:
        assert rank[name]["version_loaded"] == 1
        two, resumed = rank[name]["resume"]
        for (spec, a), (_, b) in zip(two, resumed):
            torch.testing.assert_close(b, a, atol=0, rtol=0, msg=spec.local_name)
        assert rank[name]["lrs"] == pytest.approx(SCHEDULE_LRS, rel=1e-12)


@pytest.mark.distributed
def test_checkpoint_of_a_smaller_model_is_refused(ranks):
    for rank in ranks:
        message = rank["smaller_refused"]
        assert message is not None and "not in the model:" in message and ".1." in message


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama-tp2", "llama-pp2", "llama-dp2-fsdp"])
def test_exported_checkpoint_loads_in_transformers_with_the_trainers_logprobs(
        ranks, run_dir, models, refs, tmp_path, name):
    from peerflow.adapters.megatron.engine import MegatronTrainEngine

    family, _, _ = _case(name)
    out = export_checkpoint(MegatronTrainEngine, str(run_dir / f"ckpt-{name}"), models[family],
                            str(tmp_path / "model"))
    diff = (hf_logprobs(out, full_batch()) - _logprobs(ranks, name, "logprobs_one")).abs().max()
    assert diff.item() < LOGPROB_TOL, f"{name} export: |HF - megatron| = {diff.item()}"
    from safetensors.torch import load_file

    saved = load_file(str(Path(out) / "model.safetensors"))
    assert set(saved) == set(refs[family]["state"]), "padding dropped, tied head written once"
    for spec, tensor in [item for rank in ranks for item in rank[name]["exported"]]:
        for piece in spec.pieces:  # the trainer's own shards after the step, piece by piece
            torch.testing.assert_close(saved[piece.name][piece.global_box.slices()],
                                       tensor[piece.local_box.slices()], atol=0, rtol=0,
                                       msg=f"{name} {piece.name}")


@pytest.mark.distributed
def test_checkpoint_holds_no_pickle_and_a_crafted_one_is_refused_by_name(ranks):
    """The optimiser state is safetensors + JSON; PeerFlow 0.1.0's `.pt` still loads
    untrusted (torch's restricted unpickler); a crafted `.pt` in its place is refused on
    every rank, naming it, and its `touch MARKER` payload never runs (the run-directory
    version with `peerflow export` is tests/engines/hostile/test_hostile_checkpoints.py, slow)."""
    from peerflow.checkpoint.pickles import is_pickle

    for rank in ranks:
        crafted = rank["llama-dp2-fsdp"]["crafted"]
        assert "megatron_optim_tp0_pp0.json" in crafted["files"]
        assert not any(name.endswith(".pt") for name in crafted["files"])
        assert crafted["old_format_version"] == 1
        assert crafted["refusal"] is not None and crafted["target"] in crafted["refusal"]
        assert "--trust-checkpoint" in crafted["refusal"] and not crafted["ran"]
    directory = Path(ranks[0]["llama-dp2-fsdp"]["crafted"]["target"]).parent
    assert not list(directory.parent.glob("*-pwned")), "the payload ran"
    original = directory.with_name(directory.name.removesuffix("-crafted"))
    assert not any(is_pickle(p) for p in original.iterdir())
