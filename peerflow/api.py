"""Python entry points for scripts and notebooks: `train`, `evaluate`, `export`.

Both run the same launcher as the CLI (`peerflow train` / `peerflow eval`): the config is
validated here, before any worker starts, then worker processes are spawned (or, under
`torchrun`, this process is one). A reward given as a Python function must be importable
by those processes — a top-level function of a module or a `.py` file; a lambda, a nested
function or one typed into a notebook is refused with the fix. A script needs no
`if __name__ == "__main__":` guard unless it defines its own reward function (then the
call is refused, naming the line to indent); standard input (`python - <<EOF`) and
notebooks work too (`peerflow.launch.mainguard`). `peerflow.export` writes a
run's checkpoint as a Hugging Face model directory (`peerflow export`).

    import peerflow
    from my_rewards import score

    run_dir = peerflow.train("examples/quickstart.yaml", overrides={"run.steps": 20},
                             reward_fn=score)
    peerflow.export(run_dir, "my-model")  # a Hugging Face model directory
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from peerflow.errors import ConfigError

ConfigSource = str | Path | Mapping[str, Any] | Any
RewardSource = str | Callable[..., Any] | Sequence[str | Callable[..., Any]]


def _overrides(overrides: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"
                .removesuffix("\n...") for key, value in overrides.items()]
    if isinstance(overrides, str):
        raise ConfigError(f"overrides={overrides!r}: give a list of 'key=value' strings or a "
                          "dict {key: value}.")
    return list(overrides)


def _reward_overrides(reward_fn: RewardSource | None) -> list[str]:
    from peerflow.rewards import callable_target

    if reward_fn is None:
        return []
    refs = [f if isinstance(f, str) else callable_target(f)
            for f in (reward_fn if isinstance(reward_fn, Sequence)
                      and not isinstance(reward_fn, str) else [reward_fn])]
    if len(refs) == 1:
        return [f"task.reward={refs[0]}", "task.rewards=[]"]
    return ["task.reward=null", "task.rewards=" + json.dumps([{"fn": r} for r in refs])]


def _config_path(config: ConfigSource) -> str:
    """A YAML path for the workers: the given file, or the mapping/RunConfig written out."""
    if isinstance(config, str | Path):
        return str(config)
    if not isinstance(config, Mapping):
        from peerflow.config import unstructure

        config = unstructure(config)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="peerflow-config-",
                                     delete=False) as handle:
        yaml.safe_dump(dict(config), handle, sort_keys=False)
    return handle.name


def _name(config: ConfigSource) -> str:
    return Path(config).stem if isinstance(config, str | Path) else "run"


def _prepare(config: ConfigSource, overrides: Any, reward_fn: RewardSource | None,
             nprocs: int | None, call: str) -> tuple[str, list[str], Any]:
    """Returns `(config path, overrides, validated RunConfig)`.

    Validates before any directory or process is created, as the CLI does; first of all
    refuses a top-level call in a script that defines its own reward
    (`peerflow.launch.mainguard`), since loading the reward would run the call again.
    """
    from peerflow.checkpoint.inputs import reward_refs
    from peerflow.config import load_config, unstructure
    from peerflow.launch.mainguard import check_main_guard
    from peerflow.launch.preflight import check_config

    extra = _overrides(overrides) + _reward_overrides(reward_fn)
    if nprocs is not None:
        extra.append(f"runtime.nprocs={nprocs}")
    config_path = _config_path(config)
    check_main_guard(reward_refs(unstructure(load_config(config_path, extra))), call)
    return config_path, extra, check_config(config_path, extra)


@contextlib.contextmanager
def _run_dir(run_dir: str | Path | None, name: str) -> Iterator[Path]:
    """The run directory, locked while the run uses it.

    One this call created is removed if the run left it empty (it failed first).
    """
    import os

    from peerflow.launch import in_distributed_env
    from peerflow.outputs import RunLock, create_run_dir

    fresh = run_dir is None or not Path(run_dir).expanduser().exists()
    path = create_run_dir(run_dir, name=name)
    lead = not in_distributed_env() or os.environ.get("RANK") == "0"  # one lock a run
    try:
        with RunLock(path) if lead else contextlib.nullcontext():
            yield path
    except BaseException:
        if fresh and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        raise


def train(config: ConfigSource, overrides: Mapping[str, Any] | Sequence[str] | None = None,
          reward_fn: RewardSource | None = None, *, run_dir: str | Path | None = None,
          nprocs: int | None = None, launcher: str = "elastic") -> Path:
    """Trains as `peerflow train` does and returns the run directory.

    Args:
        config: A YAML path, a mapping of config sections, or a `RunConfig`.
        overrides: `{"run.steps": 20}` or `["run.steps=20"]`, applied on top.
        reward_fn: A reward function (or `path.py:fn` / `module:fn` text), or a list of
            them (equal weights); replaces `task.reward` / `task.rewards`.
        run_dir: Output directory (default: a fresh `runs/<name>-<UTC timestamp>`).
        nprocs: Worker processes (default: `runtime.nprocs`).
        launcher: `elastic` or `ray`.

    Raises:
        ConfigError: the config or the reward is invalid (before any worker starts).
        WorkerFailedError: a worker died or raised.
    """
    from peerflow.launch import launch

    config_path, extra, settings = _prepare(config, overrides, reward_fn, nprocs,
                                            "peerflow.train()")
    with _run_dir(run_dir, _name(config)) as path:
        launch(config_path=config_path, overrides=extra, run_dir=str(path),
               nprocs=settings.runtime.nprocs, launcher=launcher,
               fault_timeout=settings.runtime.fault_timeout,
               wait_timeout=settings.runtime.peer_wait_timeout)
    return path


def evaluate(config: ConfigSource, checkpoint: str | Path | None = None,
             overrides: Mapping[str, Any] | Sequence[str] | None = None,
             reward_fn: RewardSource | None = None, *, out_dir: str | Path | None = None,
             nprocs: int | None = None, launcher: str = "elastic") -> dict[str, Any]:
    """Evaluates a checkpoint as `peerflow eval` does; returns `eval.json`'s content.

    Args:
        config: A YAML path, a mapping of config sections, or a `RunConfig`.
        checkpoint: A checkpoint or run directory (`None`: the initial model).
        overrides: Applied on top of the config (e.g. `{"eval.n": 8}`).
        reward_fn: As in `train`.
        out_dir: Where `eval.json` goes (default: a fresh `runs/eval-<name>-...`).
        nprocs: Worker processes (default: `runtime.nprocs`).
        launcher: `elastic` or `ray`.
    """
    from peerflow.launch import launch

    if checkpoint is not None and not Path(checkpoint).expanduser().is_dir():
        raise ConfigError(f"--checkpoint {str(checkpoint)!r} is not a directory; give a run "
                          "directory or one of its checkpoints/step_* directories.")
    config_path, extra, settings = _prepare(config, overrides, reward_fn, nprocs,
                                            "peerflow.evaluate()")
    if checkpoint is not None:
        _check_trained_engine(Path(checkpoint).expanduser().resolve(), settings)
    with _run_dir(out_dir, f"eval-{_name(config)}") as path:
        launch(config_path=config_path, overrides=extra, run_dir=str(path),
               checkpoint=str(Path(checkpoint).resolve()) if checkpoint is not None else None,
               nprocs=settings.runtime.nprocs, launcher=launcher,
               fault_timeout=settings.runtime.fault_timeout,
               wait_timeout=settings.runtime.peer_wait_timeout,
               entry="peerflow.worker.main:run_eval_worker")
    return json.loads((path / "eval.json").read_text())


def _check_trained_engine(checkpoint: Path, settings: Any) -> None:
    """Refuses, before any worker starts, a checkpoint another train engine wrote.

    A checkpoint's layout is its train engine's (fsdp's DCP shards, DeepSpeed's ZeRO files,
    megatron's tp/pp shards): the run's resolved `config.yaml` (beside `checkpoints/`)
    records which one, and the evaluating config must select the same.
    """
    from peerflow.checkpoint.store import run_and_step
    from peerflow.config import load_config
    from peerflow.outputs.rundir import CONFIG_FILE

    recorded = run_and_step(checkpoint)[0] / CONFIG_FILE
    if not recorded.is_file():
        return
    trained = load_config(recorded).trainer.backend
    wanted = settings.trainer.backend
    if trained != wanted:
        raise ConfigError(
            f"--checkpoint {str(checkpoint)!r} was written by trainer.backend={trained!r} "
            f"({recorded}), but the config selects trainer.backend={wanted!r}, which cannot "
            f"read it. Fix: evaluate with the run's config ({recorded}) or add "
            f"--set trainer.backend={trained}.")


def export(run_dir: str | Path, out_dir: str | Path, step: int | None = None, *,
           dtype: str = "auto", max_shard_size: int | str = "5GB") -> Path:
    """Writes a run's checkpoint as a Hugging Face model directory, as `peerflow export` does.

    The directory (safetensors, config, generation config, tokenizer and chat template)
    loads with `AutoModelForCausalLM.from_pretrained(out_dir)`. The model is assembled in
    this process: it needs host memory for one full copy of the weights.

    Args:
        run_dir: A run directory (or one of its `checkpoints/step_N` directories).
        out_dir: The model directory to create (must not exist, or be empty).
        step: The checkpoint's step (`None`: the newest verified checkpoint).
        dtype: `auto` (as saved), `float32`, `bfloat16` or `float16`.
        max_shard_size: Largest safetensors file before the weights are split.

    Returns:
        `out_dir`.

    Raises:
        ConfigError: no (such) verified checkpoint, `out_dir` not empty, or a bad dtype.
    """
    from peerflow.hf_export import export as export_run

    return export_run(run_dir, out_dir, step=step, dtype=dtype,
                      max_shard_size=max_shard_size).out_dir
