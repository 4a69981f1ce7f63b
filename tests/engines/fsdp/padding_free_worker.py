"""One gloo rank of test_padding_free: fsdp (FSDP2) and deepspeed (ZeRO-3) on two ranks,
a padded step then a padding-free one from the same weights. Writes `rank{R}.pt`."""

from __future__ import annotations

import sys

import attrs
import torch
import torch.distributed as dist

from tests.engines.fsdp.test_padding_free import TEMPERATURE, make_batch, one_step, optim


def main() -> None:
    from peerflow import ParallelLayout
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine
    from peerflow.adapters.deepspeed.options import DeepSpeedOptions
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.adapters.fsdp.shards import local_tensor
    from peerflow.engines import EngineContext

    torch.set_num_threads(1)
    model_path, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    context = EngineContext(model_path=model_path, layout=ParallelLayout(dp=world),
                            rank=rank, temperature=TEMPERATURE, process_group=dist.group.WORLD)
    batch = make_batch(61)
    mine = batch.select(range(6) if rank == 0 else range(6, len(batch)))
    out: dict = {"fsdp": [], "deepspeed": []}
    for padding_free in (False, True):
        engine = FSDPTrainEngine(context, FSDPTrainOptions(), optim(padding_free))
        step = one_step(engine, mine)
        step["weights"] = {n: local_tensor(p).detach().clone()
                           for n, p in engine.model.named_parameters()}
        out["fsdp"].append(step)
        engine.shutdown()
    # Memory controls: bf16 compute, fp32 gradient reduction, CPU offload, checkpointing.
    controls = FSDPTrainOptions(param_dtype="bfloat16", reduce_dtype="float32",
                                cpu_offload=True)
    engine = FSDPTrainEngine(context, controls, attrs.evolve(optim(True),
                                                             activation_checkpointing=True))
    out["fsdp_controls"] = one_step(engine, mine)
    engine.shutdown()
    for padding_free in (False, True):
        engine = DeepSpeedTrainEngine(context, DeepSpeedOptions(zero_stage=3),
                                      optim(padding_free))
        step = one_step(engine, mine)
        step["weights"] = {n: p.ds_tensor.detach().clone()
                           for n, p in engine.engine.module.named_parameters()}
        out["deepspeed"].append(step)
        engine.shutdown()
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
