"""One gloo rank of the DeepSpeed engine test (run by torchrun from test_deepspeed_engine).

For ZeRO stages 1, 2 and 3: log-probs, one train step on this rank's slice, the weights it
owns after the step (through `weight_sources`/`materialize`, bucket by bucket), and a
checkpoint round trip (step 2 after `load_checkpoint` equals step 2 without it) with the
log-probs at the checkpoint (for `peerflow export`), a one-layer model refusing the
two-layer checkpoint, and a copy of the ZeRO-2 checkpoint with a crafted pickle in rank 1's
optimiser file refused on both ranks (`tests.helpers.hostile`).
Writes `rank{R}.pt` into the output directory.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.engines.deepspeed.trainlib import (
    nll_loss,
    one_layer_copy,
    optim_settings,
    refused_load,
    start_gloo_rank,
)
from tests.helpers.hostile import crafted_copy


def owned(engine) -> dict[str, torch.Tensor]:
    """The HF tensors this rank sends (replica 0), materialised two specs per bucket."""
    specs = engine.weight_sources()
    out = {}
    for start in range(0, len(specs), 2):
        bucket = specs[start:start + 2]
        with engine.materialize(bucket) as tensors:
            for spec, tensor in zip(bucket, tensors):
                if spec.replica == 0:
                    out[spec.pieces[0].name] = tensor.clone()
    return out


def crafted_load(engine, ckpt: str) -> dict:
    """A copy of `ckpt` with a crafted pickle in rank 1's optimiser file, loaded."""
    crafted = crafted_copy(ckpt, "peerflow/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    return {"refusal": crafted["load"](engine), "path": str(crafted["path"]),
            "target": crafted["target"], "ran": os.path.exists(crafted["marker"])}


def main() -> None:
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine
    from peerflow.adapters.deepspeed.options import DeepSpeedOptions
    from peerflow.engines import EngineContext
    from peerflow.layout import ParallelLayout

    model_path, out_dir, rank, world, batch, context = start_gloo_rank()
    results: dict = {}
    for stage in (1, 2, 3):
        engine = DeepSpeedTrainEngine(context, DeepSpeedOptions(zero_stage=stage),
                                      optim_settings())
        logprobs = engine.forward_logprobs(batch)
        metrics = engine.train_step(batch, nll_loss)
        after_one = owned(engine)
        logprobs_one = engine.forward_logprobs(batch).values  # what the checkpoint scores
        ckpt = os.path.join(out_dir, f"ckpt{stage}")
        engine.save_checkpoint(ckpt)
        two_lr = engine.train_step(batch, nll_loss)["lr"]
        after_two = owned(engine)
        engine.load_checkpoint(ckpt)
        version_loaded = engine.version
        resumed_lr = engine.train_step(batch, nll_loss)["lr"]
        resumed = owned(engine)
        lrs = (metrics["lr"], two_lr, resumed_lr, engine.train_step(batch, nll_loss)["lr"])
        results[stage] = {
            "lrs": lrs,
            "logprobs": logprobs.values, "metrics": metrics, "after_one": after_one,
            "logprobs_one": logprobs_one,
            "after_two": after_two, "resumed": resumed, "version_loaded": version_loaded,
            "specs": engine.weight_sources(), "shares_prompts": engine.shares_prompts,
        }
        if stage == 2:
            results["crafted"] = crafted_load(engine, ckpt)
        engine.shutdown()
    smaller = EngineContext(model_path=one_layer_copy(model_path, out_dir),
                            layout=ParallelLayout(dp=world), rank=rank)
    engine = DeepSpeedTrainEngine(smaller, DeepSpeedOptions(zero_stage=2), optim_settings())
    results["smaller_refused"] = refused_load(engine, os.path.join(out_dir, "ckpt2"))
    engine.shutdown()
    try:
        DeepSpeedTrainEngine(context, DeepSpeedOptions(
            zero_stage=2, config={"zero_optimization": {"not_a_deepspeed_key": 1}}),
            optim_settings())
        results["bad_passthrough"] = None
    except Exception as exc:  # DeepSpeed's own config validation
        results["bad_passthrough"] = f"{type(exc).__name__}: {exc}"
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
