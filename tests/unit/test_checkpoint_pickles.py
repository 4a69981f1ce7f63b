"""Hostile checkpoint files: a crafted pickle is refused by name and never runs, unless the
checkpoint is trusted (`peerflow.checkpoint.pickles`); optimiser state as safetensors +
JSON round trips exactly (`peerflow.checkpoint.tensor_tree`)."""

from __future__ import annotations

import json

import pytest
import torch

from peerflow.checkpoint import newest_verified, step_dir, verify, write_manifest
from peerflow.checkpoint.pickles import (
    TRUST_ENV,
    UntrustedCheckpointError,
    check_files,
    is_pickle,
    safe_load,
    untrusted_file,
)
from peerflow.checkpoint.tensor_tree import load_tree, save_tree
from tests.helpers.hostile import Payload, forge_manifest, plant


@pytest.fixture(autouse=True)
def untrusted(monkeypatch):
    monkeypatch.setenv(TRUST_ENV, "0")


def _adamw_state() -> dict:
    layer = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(layer.parameters(), lr=0.1, betas=(0.9, 0.95))
    layer(torch.randn(4, 3)).sum().backward()
    optim.step()
    return optim.state_dict()


def _run_with_checkpoints(tmp_path, steps=(1, 2)):
    """A run directory whose checkpoints hold a torch optimiser file (safe) each."""
    for step in steps:
        actor = step_dir(tmp_path, step) / "actor"
        actor.mkdir(parents=True)
        torch.save(_adamw_state(), actor / "optim.pt")
        write_manifest(actor.parent, step=step)
    return tmp_path


def test_crafted_pickle_is_refused_by_name_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = plant(tmp_path / "optim.pt", marker)
    assert is_pickle(path)
    with pytest.raises(UntrustedCheckpointError) as refused:
        safe_load(path)
    message = str(refused.value)
    assert str(path) in message and "--trust-checkpoint" in message
    assert "posix.system" in message  # torch's own reason: the global it blocked
    with pytest.raises(UntrustedCheckpointError, match="optim.pt"):
        check_files([path])
    assert not marker.exists()


def test_trusted_means_unrestricted(tmp_path, monkeypatch):
    """The flag is what it says: a trusted crafted file runs (so never trust strangers)."""
    marker = tmp_path / "pwned"
    path = plant(tmp_path / "optim.pt", marker)
    monkeypatch.setenv(TRUST_ENV, "1")
    safe_load(path)
    assert marker.exists()


def test_plain_torch_state_loads_restricted(tmp_path):
    state = _adamw_state()
    torch.save(state, tmp_path / "optim.pt")
    loaded = safe_load(tmp_path / "optim.pt")
    assert loaded["param_groups"] == state["param_groups"]
    assert untrusted_file(tmp_path) is None


def test_verify_refuses_a_forged_checkpoint_and_resume_does_not_skip_it(tmp_path):
    run = _run_with_checkpoints(tmp_path)
    newest = step_dir(run, 2)
    marker = tmp_path / "pwned"
    plant(newest / "actor" / "optim.pt", marker)
    forge_manifest(newest)  # the checksums pass: only the pickle check stands in the way
    verdict = verify(newest)
    assert not verdict.ok and verdict.untrusted
    assert str(newest / "actor" / "optim.pt") in verdict.problem
    with pytest.raises(UntrustedCheckpointError, match="step 2.*optim.pt.*--trust-checkpoint"):
        newest_verified(run, report=lambda _: None)  # refused, not skipped for step 1
    assert verify(step_dir(run, 1)).ok
    assert verify(newest, trust=True).ok
    assert not marker.exists()


def test_an_extra_pickle_outside_the_manifest_is_refused_too(tmp_path):
    run = _run_with_checkpoints(tmp_path, steps=(1,))
    plant(step_dir(run, 1) / "actor" / "extra.bin", tmp_path / "pwned")  # any name
    assert "extra.bin" in verify(step_dir(run, 1)).problem
    assert not (tmp_path / "pwned").exists()


def test_tensor_tree_round_trips_optimizer_state_exactly(tmp_path):
    state = _adamw_state()
    save_tree(state, tmp_path / "optim")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optim.json", "optim.safetensors"]
    assert not is_pickle(tmp_path / "optim.safetensors")
    back = load_tree(tmp_path / "optim")
    assert back["param_groups"] == state["param_groups"]  # betas a tuple again
    assert list(back["state"]) == list(state["state"])  # int parameter indices again
    for index, entry in state["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(back["state"][index][key], tensor)
    odd = {"tensor": 1.5, "inf": float("inf"), "nested": [(1, "a"), {2: None}]}
    save_tree(odd, tmp_path / "odd")
    assert load_tree(tmp_path / "odd") == odd
    flat = torch.arange(6.0)
    save_tree({"a": flat, "b": flat, "view": flat[2:4]}, tmp_path / "shared")  # one storage
    shared = load_tree(tmp_path / "shared")
    assert torch.equal(shared["b"], flat) and torch.equal(shared["view"], flat[2:4])


def test_tensor_tree_refuses_what_json_cannot_hold(tmp_path):
    with pytest.raises(TypeError, match=r"state\.groups\[0\]\.fn is a Payload"):
        save_tree({"groups": [{"fn": Payload(tmp_path / "x")}]}, tmp_path / "bad")
    structure = {"items": [[0, {"tensor": "0"}]]}
    (tmp_path / "t.json").write_text(json.dumps(structure))
    from safetensors.torch import save_file

    save_file({"0": torch.ones(2)}, str(tmp_path / "t.safetensors"))
    assert torch.equal(load_tree(tmp_path / "t")[0], torch.ones(2))


def test_a_protocol_0_pickle_is_checked_before_an_unrestricted_reader(tmp_path):
    """`torch.load` reads text pickles too: `check_files` does not go by the first bytes."""
    import pickle

    marker = tmp_path / "pwned"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(pickle.dumps(Payload(marker), protocol=0))
    assert not is_pickle(path)  # not a torch file nor a protocol-2+ pickle
    with pytest.raises(UntrustedCheckpointError, match="optim_states.pt"):
        check_files([path])
    with pytest.raises(UntrustedCheckpointError):
        safe_load(path)
    assert not marker.exists()


@pytest.mark.parametrize("degrees", [{"tp": 10**9, "pp": 1}, {"tp": 1e999, "pp": 1},
                                     {"tp": 0, "pp": 1}, {"tp": 2, "pp": 1}],
                         ids=["a billion tp ranks", "infinite tp", "zero tp", "a missing shard"])
def test_export_refuses_a_megatron_layout_its_files_do_not_hold(tmp_path, degrees):
    """`saved_shards` (peerflow export) looped over the layout the JSON sidecar claims:
    `tp: 1e9` built specs until memory ran out, `1e999` (inf) raised a TypeError."""
    from peerflow.adapters.megatron.checkpoint import META, MegatronCheckpoints
    from peerflow.errors import ConfigError

    (tmp_path / "megatron_tp0_pp0.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / META).write_text(json.dumps({"version": 0, "dp": 1, **degrees}))
    with pytest.raises(ConfigError, match=f"{META}.*megatron_tp"):
        MegatronCheckpoints.saved_shards(str(tmp_path), model_path=str(tmp_path))


def test_a_pickle_reached_through_a_symlink_is_refused_too(tmp_path):
    """The early check skipped symlinks; every loader follows them (`torch.load`)."""
    run = _run_with_checkpoints(tmp_path, steps=(1,))
    outside = plant(tmp_path / "elsewhere.pt", tmp_path / "pwned")
    (step_dir(run, 1) / "actor" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").symlink_to(
        outside)
    verdict = verify(step_dir(run, 1))
    assert not verdict.ok and verdict.untrusted, verdict
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in verdict.problem
    assert not (tmp_path / "pwned").exists()


def test_a_manifest_naming_files_outside_its_directory_is_refused(tmp_path):
    run = _run_with_checkpoints(tmp_path, steps=(1,))
    manifest = step_dir(run, 1) / "MANIFEST.json"
    data = json.loads(manifest.read_text())
    data["files"]["../../../../../../../../etc/hostname"] = {"bytes": 1, "sha256": "0"}
    manifest.write_text(json.dumps(data))
    verdict = verify(step_dir(run, 1))
    assert not verdict.ok and "outside the checkpoint" in verdict.problem, verdict


@pytest.mark.parametrize("files", [[], {"a": 5}, {"a": {"bytes": "1", "sha256": 2}}, None])
def test_a_malformed_manifest_is_a_verdict_not_a_crash(tmp_path, files):
    run = _run_with_checkpoints(tmp_path, steps=(1,))
    manifest = step_dir(run, 1) / "MANIFEST.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "files": files}))
    verdict = verify(step_dir(run, 1))
    assert not verdict.ok and "MANIFEST.json" in verdict.problem, verdict
