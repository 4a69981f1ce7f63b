"""`peerflow.export`: a run's checkpoint as a Hugging Face model directory.

    peerflow export RUN_DIR OUT_DIR [--step N] [--dtype bfloat16]

Picks the newest checkpoint that verifies against its manifest (or `--step N`, which must
verify too), rebuilds the run's model source from `RUN_DIR/config.yaml` (`model.path`, or
the directory `model.builder` makes), asks the run's train adapter what its checkpoint
holds (`TrainEngine.saved_shards`: any layout — fsdp dp/tp, DeepSpeed ZeRO 1–3, Megatron
tp/pp), assembles whole HF tensors in this process (one full host copy of the model)
and writes them with the config, the generation config and the tokenizer
(`write_model_dir`). The directory is written beside `OUT_DIR` and renamed into place at
the end (`peerflow.checkpoint.atomic.atomic_path`, the one atomic writer), so a failed
export leaves nothing behind; an `OUT_DIR` with files is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from peerflow.errors import ConfigError

#: `--dtype` choices; `auto` keeps the dtype the checkpoint holds.
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: The role whose weights are exported (the policy).
ROLE = "actor"
INFO_FILE = "peerflow_export.json"


@attrs.frozen(kw_only=True)
class Exported:
    """What `export` wrote."""

    out_dir: Path
    """The model directory."""
    step: int
    """The training step of the exported checkpoint."""
    checkpoint: Path
    """The checkpoint directory it was read from."""
    backend: str
    """The train adapter that wrote the checkpoint (`trainer.backend`)."""
    dtype: str
    """The dtype of the written weights."""
    parameters: int
    """Elements written (tied tensors once)."""


def _run_and_step(run_dir: Path, step: int | None) -> tuple[Path, int | None]:
    """Accepts `RUN_DIR/checkpoints/step_N` for `RUN_DIR --step N`."""
    from peerflow.checkpoint.store import run_and_step

    run, named = run_and_step(run_dir)
    if named is None:
        return run_dir, step
    if step is not None and step != named:
        raise ConfigError(f"{run_dir} is the checkpoint of step {named} but --step "
                          f"{step} was given; give the run directory with --step, or "
                          "the checkpoint directory alone.")
    return run, named


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(
            f"OUT_DIR {str(out_dir)!r} exists and is not an empty directory; export never "
            "overwrites. Give a new (or empty) directory, or remove that one first."
        )


def choose_checkpoint(run_dir: Path, step: int | None,
                      report: Callable[[str], None] = print) -> Any:
    """The `CheckpointInfo` to export: `step`'s, or the newest verified one.

    Raises:
        ConfigError: the run has no verified checkpoint, `step` has none, or it fails
            verification (each naming what to do instead).
    """
    from peerflow.checkpoint import list_checkpoints, newest_verified, verify

    infos = list_checkpoints(run_dir)
    steps = ", ".join(str(i.step) for i in infos) or "none"
    if step is None:
        chosen = newest_verified(run_dir, report)
        if chosen is None:
            raise ConfigError(
                f"{run_dir} has no verified checkpoint (checkpoints found: {steps}); a run "
                "saves one every run.checkpoint_every steps and after its last step. Train "
                "(or resume) it until one is saved; `peerflow checkpoints RUN_DIR` lists them."
            )
        return chosen
    chosen = next((i for i in infos if i.step == step), None)
    if chosen is None:
        raise ConfigError(f"{run_dir} has no checkpoint of step {step} (checkpoints: {steps}); "
                          "pick one of those with --step, or leave --step out for the newest.")
    verdict = verify(chosen.path)
    if not verdict.ok:
        raise ConfigError(f"the checkpoint of step {step} ({chosen.path}) fails verification: "
                          f"{verdict.problem}. Export another step (`peerflow checkpoints "
                          f"{run_dir}` shows which verify).")
    return attrs.evolve(chosen, verdict=verdict)


def _check_model_source(run_dir: Path, config: Any) -> None:
    """Refuses a model directory whose architecture or tokenizer changed since the run."""
    from peerflow.checkpoint.fingerprint import fingerprint, recorded_fingerprint

    recorded = recorded_fingerprint(run_dir) or {}
    now = fingerprint(config)
    changed = [key for key in sorted(set(recorded) | set(now))
               if key.startswith(("model.architecture.", "tokenizer."))
               and key in recorded and recorded.get(key) != now.get(key)]
    if changed:
        raise ConfigError(
            f"model.path {config.model.path!r} changed since the run ({', '.join(changed)} "
            f"differ from {run_dir / 'fingerprint.json'}); export needs the model directory "
            "the run was trained from."
        )


def checkpoint_tensors(config: Any, role_dir: Path, model_path: str, *,
                       dtype: str = "auto") -> dict[str, Any]:
    """Whole HF tensors of one role's checkpoint, read through the run's train adapter.

    Raises:
        ConfigError: the adapter cannot describe its checkpoints.
    """
    from peerflow.config import structure_options
    from peerflow.hf_export.assemble import assemble_hf_tensors
    from peerflow.plugins import get_plugin_manager
    from peerflow.training import torch_dtype

    backend = config.trainer.backend
    cls = get_plugin_manager().get("train_engine", backend)
    if not cls.capabilities.checkpoint:
        raise ConfigError(f"trainer.backend={backend!r} does not declare Capabilities."
                          "checkpoint, so its runs have no checkpoints to export.")
    options = structure_options(getattr(cls, "options_class", object),
                                config.trainer.engine_options.get(backend), f"trainer.{backend}")
    try:
        shards = cls.saved_shards(str(role_dir), model_path=model_path, options=options)
    except NotImplementedError as exc:
        raise ConfigError(f"trainer.backend={backend!r}: {exc}") from None
    return assemble_hf_tensors(shards, dtype=None if dtype == "auto" else torch_dtype(dtype))


def _model_files(model_path: str) -> dict[str, Any]:
    """The source model's config, generation config (if any) and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    generation = None
    if (Path(model_path) / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(model_path)
    return {"config": AutoConfig.from_pretrained(model_path), "generation_config": generation,
            "tokenizer": AutoTokenizer.from_pretrained(model_path)}


def export(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
           dtype: str = "auto", max_shard_size: int | str = "5GB",
           log: Callable[[str], None] = print, lora: str = "adapter") -> Exported:
    """Writes a run's checkpoint as a Hugging Face model directory.

    Args:
        run_dir: The run directory (or one of its `checkpoints/step_N` directories).
        out_dir: The model directory to create (must not exist, or be empty).
        step: The checkpoint's step (`None`: the newest verified checkpoint).
        dtype: `auto` (as the checkpoint holds them), `float32`, `bfloat16` or `float16`.
        max_shard_size: Largest safetensors file before the weights are split (`"5GB"`).
        log: Where checkpoints skipped for failing verification are reported.
        lora: A `trainer.lora` run's export: `adapter` (peft's format) or `merged` (the
            base model with the adapters merged in); see `peerflow.hf_export.lora`.

    Returns:
        What was written.

    Raises:
        ConfigError: not a run directory, no (such) verified checkpoint, `out_dir` not
            empty, an unknown dtype, or a model source that changed since the run.
    """
    from peerflow.checkpoint.atomic import atomic_path
    from peerflow.config import load_config
    from peerflow.hf_export.hf_dir import write_model_dir
    from peerflow.plugins import get_plugin_manager
    from peerflow.worker.runtime import resolve_model_path

    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}.")
    run_dir, step = _run_and_step(Path(run_dir).expanduser(), step)
    out_dir = Path(out_dir).expanduser()
    _check_out_dir(out_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); give the "
                          "directory `peerflow train` wrote (--run-dir).")
    config = load_config(run_dir / "config.yaml")
    info = choose_checkpoint(run_dir, step, log)
    role_dir = info.path / ROLE
    if not role_dir.is_dir():
        raise ConfigError(f"checkpoint {info.path} holds no {ROLE!r} weights (it has "
                          f"{sorted(p.name for p in info.path.iterdir() if p.is_dir())}).")
    _check_model_source(run_dir, config)
    model_path = resolve_model_path(config, get_plugin_manager())
    tensors = checkpoint_tensors(config, role_dir, model_path, dtype=dtype)
    with atomic_path(out_dir) as tmp:
        if config.trainer.lora is None:
            write_model_dir(tmp, tensors, max_shard_size=max_shard_size,
                            **_model_files(model_path))
        else:
            from peerflow.hf_export.lora import write_lora

            tensors = write_lora(tmp, tensors, lora=config.trainer.lora, model_path=model_path,
                                 mode=lora, files=_model_files(model_path),
                                 max_shard_size=max_shard_size)
        result = Exported(out_dir=out_dir, step=info.step, checkpoint=info.path,
                          backend=config.trainer.backend,
                          dtype=str(next(iter(tensors.values())).dtype).removeprefix("torch."),
                          parameters=sum(t.numel() for t in tensors.values()))
        (tmp / INFO_FILE).write_text(json.dumps(
            {"run_dir": str(run_dir.resolve()), "step": result.step,
             "checkpoint": str(info.path.resolve()), "backend": result.backend,
             "dtype": result.dtype, "parameters": result.parameters}, indent=1) + "\n")
    return result
