"""Checks that open the run's inputs before any worker starts (no weights are loaded).

`peerflow config validate` and `peerflow train` call `preflight(config, pm)` after
`validate_config`: it opens the model directory (config and tokenizer, not the weights)
and the task's training data (its size and first example), and raises one `ConfigError`
listing every problem with the file or key and the fix. Workers do not repeat it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peerflow.errors import ConfigError, PeerFlowError
from peerflow.rollout.prompts import TOKENIZER_FILES, load_tokenizer


def check_model_dir(path: str | Path) -> list[str]:
    """Problems with a local model directory: its config and tokenizer (weights unread).

    Returns:
        One message per problem (empty when the directory can be loaded).
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        return [f"model.path={str(path)!r} is not a directory; point it at a local Hugging "
                "Face model directory (config.json, weights, tokenizer)."]
    problems = []
    if not (path / "config.json").is_file():
        problems.append(f"model directory {str(path)!r} has no config.json; save the model "
                        "there with `model.save_pretrained(DIR)`.")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"model directory {str(path)!r} has no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES)}); save the tokenizer next to the weights: "
            f"`AutoTokenizer.from_pretrained(SOURCE).save_pretrained({str(path)!r})`.")
        return problems
    try:
        load_tokenizer(path)
    except ConfigError as exc:
        problems.append(str(exc))
    return problems


def check_dataset(config: Any, pm: Any) -> list[str]:
    """Problems opening the task's training data: its size and first example.

    The first example also checks that TRL-style rewards find their keyword columns
    (`peerflow.rewards.setup.check_reward_columns`) and that chat prompts meet a
    tokenizer with a chat template.
    """
    from peerflow.worker.runtime import build_components

    try:
        task = build_components(config, pm)["task"]
        size = task.size("train")
        if size == 0:
            return [f"task {config.task.name!r}: the training split is empty; check "
                    "task.options (the dataset file or split)."]
        example = task.example("train", 0, config.seed)
        from peerflow.rewards.setup import check_reward_columns

        problems = check_reward_columns(config, pm, example)
    except PeerFlowError as exc:
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001 - a plugin's own error, shown with its type
        return [f"task {config.task.name!r} (task.options {dict(config.task.options)}): "
                f"opening the training data failed: {type(exc).__name__}: {exc}"]
    if config.model.path and isinstance(example.prompt, list):
        from peerflow.rollout.prompts import chat_template_problem

        try:  # a tokenizer that does not load is check_model_dir's to report
            tokenizer = load_tokenizer(config.model.path)
        except ConfigError:
            return problems
        problems += chat_template_problem(tokenizer, f"model.path={config.model.path!r}")
    return problems


def preflight(config: Any, pm: Any) -> None:
    """Opens the model directory and the dataset; raises listing every problem.

    Raises:
        ConfigError: one line per problem.
    """
    problems = check_model_dir(config.model.path) if config.model.path else []
    problems += check_dataset(config, pm)
    if problems:
        raise ConfigError("\n".join(problems))


def check_config(config_path: str, overrides: list[str]) -> Any:
    """Loads and validates a run's config, then opens its model directory and dataset.

    What `peerflow train` and `peerflow.api.train` run before any process or directory
    is created.

    Args:
        config_path: The YAML file.
        overrides: `--set KEY=VALUE` overrides.

    Returns:
        The validated `RunConfig`.

    Raises:
        ConfigError: the config, its model directory or its data (every problem named).
    """
    from peerflow.config import load_config, validate_config
    from peerflow.plugins import load_plugins

    config = load_config(config_path, overrides)
    pm = load_plugins()
    validate_config(config, pm)
    preflight(config, pm)
    return config
