"""`peerflow train` with `trainer.lora`, sync and async, single- and multi-turn: no special path.

The same driver, weight-sync service and checkpoint layout as full fine-tuning; what
changes is what they carry (the adapters only). Temperature 0.7 throughout.
"""

from __future__ import annotations

import pytest

from tests.helpers.configs import ASYNC_SPLIT_PAIR

pytestmark = pytest.mark.distributed

LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8", "rollout.sampling.temperature=0.7",
        "trainer.lr=0.05", "algorithm.kl.coef=0.1"]


TRAINERS = {
    "fsdp_dp2": ["trainer.layout.dp=2"],  # FSDP2 shards of every adapter
    "fsdp_tp2": ["trainer.layout.tp=2"],  # adapters split with their base layers
}  # DeepSpeed's reference view and export: tests/engines/deepspeed/test_deepspeed_lora.py


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_sync_run_trains_and_syncs_adapters_only(tmp_path, quickstart, tiny, metrics_of,
                                                 peerflow_train, quickstart_run, trainer):
    from safetensors import safe_open

    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*tiny, *LORA, "run.steps=3", "rollout.sampling.n=8",
                    "run.checkpoint_every=3", *TRAINERS[trainer]])
    rows = metrics_of(run_dir)
    full_sync = metrics_of(quickstart_run)[0]["weight_sync/bytes"]
    assert [m["step"] for m in rows] == [1, 2, 3]
    for row in rows:
        # the rollout samples from the adapted policy the trainer scores (peft on both)
        assert row["mismatch/abs_max"] < 1e-4
        assert 0 < row["weight_sync/bytes"] < full_sync / 4
    # the reference is the base model: the trained adapters move the policy away from it
    assert rows[0]["kl/mean"] < 1e-9 < 1e-4 < rows[-1]["kl/mean"]
    actor = run_dir / "checkpoints" / "step_000003" / "actor"
    for rank in (0, 1):
        with safe_open(str(actor / f"model-rank{rank}.safetensors"), "pt") as saved:
            names = list(saved.keys())
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    _check_exports(run_dir, tmp_path)


def _check_exports(run_dir, tmp_path):
    """`peerflow export` writes the adapter (peft) and the merged model; they agree."""
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peerflow.hf_export import export

    export(run_dir, tmp_path / "adapter")
    export(run_dir, tmp_path / "merged", lora="merged")
    base = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                        str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        want, got = adapted(ids).logits, merged(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (want - base_logits).abs().max() > 1e-3  # the trained adapters are in them


def test_async_agent_run_with_adapters(tmp_path, quickstart, tiny, metrics_of,
                                         peerflow_train):
    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(run_dir)],
                   [*tiny, *LORA, *ASYNC_SPLIT_PAIR, "run.steps=3",
                    "rollout.agent.environment=retry", "rollout.agent.max_turns=2",
                    "rollout.agent.max_total_tokens=24", "rollout.sampling.n=8",
                    "rollout.agent.options.turn_discount=0.5",
                    "rollout.sampling.temperature=1.0"])  # the exact-match retry task needs it
    rows = metrics_of(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for row in rows:
        assert row["staleness/max"] <= 1 and 1 <= row["agent/turns_mean"] <= 2
        assert row["kl/mean"] < 1e-3  # the base reference: its adapters off, not re-loaded
