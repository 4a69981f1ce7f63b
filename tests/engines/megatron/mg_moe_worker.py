"""One gloo rank of `test_megatron_moe.py`: the megatron adapter on a tiny Qwen3-MoE.

argv: OUT_DIR QWEN3_MOE_DIR MIXTRAL_DIR. Three cases on the 2 ranks, one after another:

* `ep2` — Qwen3-MoE, `ParallelLayout(ep=2)`: each rank holds 2 of the 4 experts of every
  layer and both ranks see the same batch;
* `dp2` — Qwen3-MoE, `ParallelLayout(dp=2)` (ep = 1): each rank holds every expert and
  half the batch;
* `mixtral-ep2` — Mixtral (checkpoint names `block_sparse_moe.experts.{e}.w1/w3/w2`),
  `ParallelLayout(ep=2)`.

Per case: log-probs routed natively; r2 recording then r3 replay of those routes (must
reproduce them bit for bit); r3 replay of the bf16 hf rollout's routes; one r3 train
step (`moe/*` metrics; with ep = 1 also the fsdp trainer's gradient norm of that
step, r3 included); the exported shards after it; a weight sync to an hf rollout
engine (dp = 2, one per rank) and its live weights; a checkpoint round trip. Writes
`rank{R}.pt`, with the HF reference log-probs of each model's batch (`hf`, `hf-mixtral`).
"""

from __future__ import annotations

import os
import sys

import attrs
import torch
import torch.distributed as dist

from tests.engines.deepspeed import trainlib
from tests.engines.megatron.mg_worker import exported

PROMPTS = ["12+3=", "abc", "hello world", "7-2=", "zz", "the answer is", "q", "99"]
TEMPERATURE = 0.7


def rollout_batch(model_path: str):
    """8 prompts × 2 answers sampled by the hf engine in bfloat16, with its routes."""
    from peerflow import ParallelLayout, SamplingParams
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.engines import EngineContext
    from tests.engines.fsdp.fsdp_testlib import sampled_batch

    engine = HFRolloutEngine(EngineContext(model_path=model_path, layout=ParallelLayout(),
                                           dtype="bfloat16"))
    batch, _ = sampled_batch(engine, PROMPTS, SamplingParams(n=2, max_tokens=8, seed=3,
                                                             temperature=TEMPERATURE))
    # a sampled pad token (the hf engine samples the whole vocabulary): transformers'
    # `padding_idx` keeps its zero embedding out of the gradient, and so must Megatron
    batch.ragged("response_ids").values[0] = engine.tokenizer.pad_token_id
    return batch


def fsdp_grad_norm(model_path: str, batch, optim) -> float:
    """The fsdp trainer's gradient norm of the same step (dp = 2, transformers modules)."""
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.engines import EngineContext
    from peerflow.layout import ParallelLayout
    from tests.engines.fsdp.fsdp_testlib import nll_loss

    context = EngineContext(model_path=model_path, layout=ParallelLayout(dp=2),
                            rank=dist.get_rank(), process_group=dist.group.WORLD,
                            temperature=TEMPERATURE)
    engine = FSDPTrainEngine(context, FSDPTrainEngine.options_class(), optim)
    norm = engine.train_step(batch, nll_loss)["grad_norm"]
    engine.shutdown()
    return norm


def run_case(name: str, layout, model_path: str, full, out_dir: str) -> dict:
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.adapters.megatron.engine import MegatronTrainEngine
    from peerflow.engines import EngineContext, OptimSettings
    from peerflow.layout import ParallelLayout
    from peerflow.reshard.service import WeightSyncService
    from peerflow.routes import OLD_ROUTES, ROUTES
    from tests.engines.fsdp.fsdp_testlib import nll_loss

    rank = dist.get_rank()
    dp = layout.coord(rank).dp
    batch = full if layout.dp == 1 else full.select(range(dp * 8, dp * 8 + 8))
    context = EngineContext(model_path=model_path, layout=layout, rank=rank,
                            temperature=TEMPERATURE)
    # no aux loss in the step (its value depends on how samples group into micro-batches,
    # which differs between the cases); Adam's eps=1e-3 keeps near-zero gradients' float
    # noise out of the ep2-vs-dp2 comparison of the stepped weights
    optim = OptimSettings(lr=1e-2, eps=1e-3, micro_batch_tokens=64, routing_replay="r2")
    engine = MegatronTrainEngine(context, None, optim)
    result = {"native": engine.forward_logprobs(batch).values}  # r2 records the routes
    own = batch.select(range(len(batch)))
    own.set(ROUTES, batch.ragged(OLD_ROUTES))
    engine.routing.mode = "r3"
    result["own_routes"] = batch.ragged(OLD_ROUTES).values
    result["replayed_own"] = engine.forward_logprobs(own).values
    result["own_metrics"] = engine.routing.step_metrics(own, engine.dp_group)
    result["replayed_rollout"] = engine.forward_logprobs(batch).values
    result["metrics"] = engine.train_step(batch, nll_loss)
    if layout.ep == 1:
        result["fsdp_grad_norm"] = fsdp_grad_norm(model_path, batch,
                                                  attrs.evolve(optim, routing_replay="r3"))
    result["exported"] = exported(engine)
    hf = HFRolloutEngine(EngineContext(model_path=model_path, layout=ParallelLayout(dp=2),
                                       rank=rank))
    WeightSyncService.build(engine, hf).sync(engine.version)
    targets = hf.weight_targets()
    result["hf"] = list(zip(targets, [t.clone() for t in hf.weight_buffers(targets)],
                            strict=True))
    ckpt = os.path.join(out_dir, f"ckpt-{name}")
    engine.save_checkpoint(ckpt)
    engine.train_step(batch, nll_loss)
    engine.load_checkpoint(ckpt)
    result["resumed"] = exported(engine)
    result["version_loaded"] = engine.version
    engine.shutdown()
    return result


def main() -> None:
    from peerflow.layout import ParallelLayout

    torch.set_num_threads(1)
    out_dir, model_path, mixtral = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    full, mixtral_batch = rollout_batch(model_path), rollout_batch(mixtral)
    results = {name: run_case(name, layout, model_path, full, out_dir)
               for name, layout in (("ep2", ParallelLayout(ep=2)), ("dp2", ParallelLayout(dp=2)))}
    results["mixtral-ep2"] = run_case("mixtral-ep2", ParallelLayout(ep=2), mixtral,
                                      mixtral_batch, out_dir)
    trainlib.TEMPERATURE = TEMPERATURE
    results["hf"] = trainlib.hf_logprobs(model_path, full)  # transformers' own forward
    results["hf-mixtral"] = trainlib.hf_logprobs(mixtral, mixtral_batch)
    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
