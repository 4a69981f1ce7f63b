"""One gloo rank of the DeepSpeed LoRA test (run from test_deepspeed_lora).

For ZeRO stages 1, 2 and 3 with `trainer.lora`: what `weight_sources` lists, the adapters
before and after one train step on this rank's slice (through `materialize`), the
optimiser state this rank holds, the reference view's (adapters off) log-probs, and a
checkpoint round trip. Writes `rank{R}.pt`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.engines.deepspeed.ds_worker import owned
from tests.engines.deepspeed.trainlib import nll_loss, start_gloo_rank
from tests.unit.test_lora_toolkit import LORA


def optimiser_elements(engine) -> int:
    """Elements of AdamW's first moment this rank holds (its ZeRO partition)."""
    state = engine.engine.optimizer.optimizer.state
    return sum(int(s["exp_avg"].numel()) for s in state.values() if "exp_avg" in s)


def main() -> None:
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine
    from peerflow.adapters.deepspeed.options import DeepSpeedOptions
    from peerflow.engines import OptimSettings
    from peerflow.training.lora import BaseModelView

    _, out_dir, rank, world, batch, context = start_gloo_rank(lora=LORA)
    results: dict = {}
    for stage in (1, 2, 3):
        engine = DeepSpeedTrainEngine(context, DeepSpeedOptions(zero_stage=stage),
                                      OptimSettings(lr=5e-2))
        before = owned(engine)
        engine.train_step(batch, nll_loss)
        after = owned(engine)
        adapted = engine.forward_logprobs(batch).values
        base = BaseModelView(engine).forward_logprobs(batch).values  # the KL reference
        ckpt = os.path.join(out_dir, f"ckpt{stage}")
        engine.save_checkpoint(ckpt)
        engine.train_step(batch, nll_loss)
        engine.load_checkpoint(ckpt)
        results[stage] = {
            "names": [s.local_name for s in engine.weight_sources()],
            "adapted": adapted, "base": base,
            "before": before, "after": after, "reloaded": owned(engine),
            "optimiser_elements": optimiser_elements(engine),
            "trainable": sorted(n for n, p in engine._module.named_parameters()
                                if p.requires_grad),
        }
        engine.shutdown()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
