"""DeepSpeed with `trainer.lora`: ZeRO 1/2/3 on two gloo ranks.

They train the adapters only, as the one-process fsdp engine does, hold optimiser state
for them only, and checkpoint them (with that state) only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.deepspeed.trainlib import (  # noqa: E402
    TEMPERATURE,
    full_batch,
    nll_loss,
)

pytest.importorskip("deepspeed")
pytest.importorskip("peft")
pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("ds_lora_worker.py")


def _merged(ranks: list[dict], stage: int, key: str) -> dict[str, torch.Tensor]:
    return {**ranks[0][stage][key], **ranks[1][stage][key]}


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_zero_trains_adapters_like_the_reference(ranks, tiny, stage):
    from peerflow import ParallelLayout
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.engines import EngineContext, OptimSettings
    from tests.unit.test_lora_toolkit import LORA

    names = ranks[0][stage]["names"]
    assert names == ranks[1][stage]["names"] and len(names) == 12
    assert all(".lora_" in n for n in ranks[0][stage]["trainable"])
    before, after = _merged(ranks, stage, "before"), _merged(ranks, stage, "after")
    assert sorted(before) == sorted(names)  # every adapter sent by exactly one owner
    # optimiser state: the adapters' elements over both ranks (ZeRO partitions), no more
    adapter_elements = sum(t.numel() for t in before.values())
    held = sum(r[stage]["optimiser_elements"] for r in ranks)
    assert adapter_elements <= held < adapter_elements + 64
    reference = FSDPTrainEngine(
        EngineContext(model_path=tiny, layout=ParallelLayout(), lora=LORA,
                      temperature=TEMPERATURE), None, OptimSettings(lr=5e-2))
    with torch.no_grad():
        for name, param in reference._named_params():
            param.copy_(before[name])
    reference.train_step(full_batch(), nll_loss)
    for name, param in reference._named_params():
        torch.testing.assert_close(after[name], param.detach(), atol=2e-5, rtol=1e-4)
    reloaded = _merged(ranks, stage, "reloaded")
    for name in names:
        assert torch.equal(reloaded[name], after[name]), name


@pytest.mark.parametrize("stage", (1, 3))
def test_reference_view_and_export_read_the_adapters(ranks, run_dir, tiny, stage):
    """The KL reference (adapters off) scores like the base model; `peerflow export`
    reads the saved adapters back under peft's names."""
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine
    from peerflow.adapters.deepspeed.options import DeepSpeedOptions
    from peerflow.hf_export.assemble import assemble_hf_tensors
    from tests.engines.deepspeed.trainlib import dp_slice, hf_logprobs

    for rank, result in enumerate(ranks):
        base = hf_logprobs(tiny, dp_slice(full_batch(), rank, 2)).to(result[stage]["base"])
        torch.testing.assert_close(result[stage]["base"], base, atol=1e-5, rtol=0)
        assert (result[stage]["adapted"] - base).abs().max() > 1e-3
    shards = DeepSpeedTrainEngine.saved_shards(str(run_dir / f"ckpt{stage}"), model_path=tiny,
                                               options=DeepSpeedOptions(zero_stage=stage))
    saved = assemble_hf_tensors(shards)
    after = _merged(ranks, stage, "after")
    assert sorted(saved) == sorted(after)
    for name, tensor in after.items():
        torch.testing.assert_close(saved[name], tensor, atol=0, rtol=0)
