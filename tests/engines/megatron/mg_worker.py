"""One gloo rank of the Megatron engine test (run by torchrun from test_megatron_engine).

argv: OUT_DIR then JSON `[[name, family, model_path, tp, pp], ...]`. For every case:
log-probs, one train step, this rank's exported shards after the step (specs + tensors),
and for the first tp and pp cases a checkpoint round trip (with the log-probs at the
checkpoint, for `peerflow export`). With `fsdp` in a case name the
same log-probs are also taken from the `fsdp` trainer on the same weights. A one-layer
copy of the dp case's model must refuse that case's checkpoint, and a crafted pickle in a
copy of it is refused (`crafted_loads`). Writes `rank{R}.pt`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

from tests.engines.deepspeed import trainlib


def exported(engine) -> list:
    """`(spec, tensor)` of every local shard, materialised spec by spec."""
    out = []
    for spec in engine.weight_sources():
        with engine.materialize([spec]) as (tensor,):
            out.append((spec, tensor.clone()))
    return out


def fsdp_logprobs(model_path: str, batch, rank: int, world: int) -> torch.Tensor:
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.engines import EngineContext
    from peerflow.layout import ParallelLayout

    context = EngineContext(model_path=model_path, layout=ParallelLayout(dp=world), rank=rank,
                            process_group=dist.group.WORLD, temperature=trainlib.TEMPERATURE)
    engine = FSDPTrainEngine(context, FSDPTrainEngine.options_class(), trainlib.optim_settings())
    values = engine.forward_logprobs(batch).values
    engine.shutdown()
    return values


def crafted_loads(engine, ckpt: str) -> dict:
    """The dp case's checkpoint with PeerFlow 0.1.0's optimiser file (a torch pickle) in
    place of the safetensors + JSON pair: loads untrusted; with a crafted pickle there
    instead: refused (`tests.helpers.hostile`)."""
    from tests.helpers.hostile import crafted_copy

    optim = ["megatron_optim_tp0_pp0.json", "megatron_optim_tp0_pp0.safetensors"]
    old = f"{ckpt}-0.1.0"
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, old)
        for name in optim:
            os.unlink(os.path.join(old, name))
        torch.save(engine.optimizer.state_dict(), os.path.join(old, "megatron_optim_tp0_pp0.pt"))
    dist.barrier()
    engine.version = 0
    engine.load_checkpoint(old)
    crafted = crafted_copy(ckpt, "megatron_optim_tp0_pp0.pt", remove=tuple(optim))
    return {"old_format_version": engine.version, "refusal": crafted["load"](engine),
            "target": crafted["target"], "ran": os.path.exists(crafted["marker"]),
            "files": sorted(os.listdir(ckpt))}


def main() -> None:
    from peerflow.adapters.megatron.engine import MegatronTrainEngine
    from peerflow.engines import EngineContext
    from peerflow.layout import ParallelLayout

    torch.set_num_threads(1)
    out_dir, cases = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    checkpointed: set[str] = set()
    for name, _family, model_path, tp, pp in cases:
        layout = ParallelLayout(dp=world // (tp * pp), tp=tp, pp=pp)
        batch = trainlib.dp_slice(trainlib.full_batch(), layout.dp_rank(rank), layout.dp)
        context = EngineContext(model_path=model_path, layout=layout, rank=rank,
                                temperature=trainlib.TEMPERATURE)
        engine = MegatronTrainEngine(context, None, trainlib.optim_settings())
        result = {"logprobs": engine.forward_logprobs(batch).values, "dp": layout.dp}
        result["metrics"] = engine.train_step(batch, trainlib.nll_loss)
        result["exported"] = exported(engine)
        kind = "tp" if tp > 1 else "pp" if pp > 1 else "dp"
        if kind not in checkpointed:
            checkpointed.add(kind)
            ckpt = os.path.join(out_dir, f"ckpt-{name}")
            result["logprobs_one"] = engine.forward_logprobs(batch).values  # for the export
            engine.save_checkpoint(ckpt)
            two_lr = engine.train_step(batch, trainlib.nll_loss)["lr"]
            two = exported(engine)
            engine.load_checkpoint(ckpt)
            result["version_loaded"] = engine.version
            resumed_lr = engine.train_step(batch, trainlib.nll_loss)["lr"]
            result["resume"] = (two, exported(engine))
            result["lrs"] = (result["metrics"]["lr"], two_lr, resumed_lr,
                             engine.train_step(batch, trainlib.nll_loss)["lr"])
            if kind == "dp":
                result["crafted"] = crafted_loads(engine, ckpt)
        engine.shutdown()
        if "fsdp" in name:
            result["fsdp_logprobs"] = fsdp_logprobs(model_path, batch, rank, world)
        results[name] = result
        if kind == "dp" and "version_loaded" in result:
            smaller = EngineContext(model_path=trainlib.one_layer_copy(model_path, out_dir),
                                    layout=layout, rank=rank)
            engine = MegatronTrainEngine(smaller, None, trainlib.optim_settings())
            results["smaller_refused"] = trainlib.refused_load(engine, ckpt)
            engine.shutdown()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
