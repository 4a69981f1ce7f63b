"""One gloo rank of test_hostile_checkpoints: a real checkpoint, then a crafted one.

argv: OUT_DIR MODEL_DIR BACKEND (`deepspeed` or `megatron`). Trains one step, saves step
1 through the run driver's `save_step` (manifest and all) into `OUT_DIR/run`, resumes it
with `restore_latest` (the pickle-free round trip), then plants a crafted pickle
(`tests.helpers.hostile`) in the actor's optimiser file, forges the manifest, and tries
again: `restore_latest` (what `train --resume` and `eval --checkpoint RUN_DIR` call) and
the engine's own `load_checkpoint` (what `eval --checkpoint STEP_DIR` calls). For
Megatron it also loads the optimiser file PeerFlow 0.1.0 wrote (a plain torch pickle).
Writes `OUT_DIR/BACKEND.json`: the refusals, and whether the marker file existed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tests.engines.deepspeed import trainlib
from tests.helpers.hostile import forge_manifest, plant


def _engine(backend: str, model_path: str):
    from peerflow.engines import EngineContext
    from peerflow.layout import ParallelLayout

    context = EngineContext(model_path=model_path, layout=ParallelLayout(dp=1), rank=0,
                            temperature=trainlib.TEMPERATURE)
    if backend == "deepspeed":
        from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine
        from peerflow.adapters.deepspeed.options import DeepSpeedOptions

        return DeepSpeedTrainEngine(context, DeepSpeedOptions(zero_stage=2),
                                    trainlib.optim_settings())
    from peerflow.adapters.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(context, None, trainlib.optim_settings())


def _refusal(call) -> str | None:
    from peerflow.checkpoint.pickles import UntrustedCheckpointError

    try:
        call()
    except UntrustedCheckpointError as exc:
        return str(exc)
    return None


def _optimizer_file(backend: str, actor: Path) -> Path:
    """The file the attacker replaces, after making the loader read it (Megatron)."""
    if backend == "deepspeed":
        return next(actor.rglob("*_optim_states.pt"))
    for name in ("megatron_optim_tp0_pp0.json", "megatron_optim_tp0_pp0.safetensors"):
        (actor / name).unlink()  # a 0.1.0-style checkpoint: its optimiser file is a .pt
    return actor / "megatron_optim_tp0_pp0.pt"


def _old_format_loads(engine, actor: Path) -> bool:
    """Megatron: the optimiser file PeerFlow 0.1.0 wrote (torch.save) loads untrusted."""
    stem = actor / "megatron_optim_tp0_pp0"
    torch.save(engine.optimizer.state_dict(), f"{stem}.pt")
    for suffix in (".json", ".safetensors"):
        Path(f"{stem}{suffix}").rename(f"{stem}{suffix}.new")
    engine.load_checkpoint(str(actor))
    for suffix in (".json", ".safetensors"):
        Path(f"{stem}{suffix}.new").rename(f"{stem}{suffix}")
    os.unlink(f"{stem}.pt")
    return engine.version == 1


def main() -> None:
    import torch.distributed as dist

    from peerflow.checkpoint import restore_latest, save_step, step_dir
    from peerflow.checkpoint.pickles import is_pickle

    torch.set_num_threads(1)
    out_dir, model_path, backend = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    run = out_dir / "run"
    engine = _engine(backend, model_path)
    engine.train_step(trainlib.full_batch(), trainlib.nll_loss)
    save_step(run, 1, engines={"actor": engine}, rank=0, log=lambda _: None)
    actor = step_dir(run, 1) / "actor"
    result = {"pickles": sorted(str(p.relative_to(actor)) for p in actor.rglob("*")
                                if p.is_file() and is_pickle(p))}
    engine.version = 0
    result["resumed_step"] = restore_latest(run, engines={"actor": engine}, rank=0).step
    result["version"] = engine.version
    if backend == "megatron":
        result["old_format_loads"] = _old_format_loads(engine, actor)
    marker = out_dir / f"{backend}-pwned"
    target = plant(_optimizer_file(backend, actor), marker)
    forge_manifest(step_dir(run, 1))
    result["target"] = str(target)
    result["resume_refusal"] = _refusal(
        lambda: restore_latest(run, engines={"actor": engine}, rank=0))
    result["load_refusal"] = _refusal(lambda: engine.load_checkpoint(str(actor)))
    result["marker_after_refusals"] = marker.exists()
    (out_dir / f"{backend}.json").write_text(json.dumps(result))
    engine.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
