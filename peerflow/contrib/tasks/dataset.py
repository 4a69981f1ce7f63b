"""`dataset`: prompts and answers from a local parquet or jsonl file (HF `datasets`).

Every row must have a non-empty string in the prompt column and a value in the answer
column; the first bad row is reported with its file, row number and column. Rows are
shuffled by the run's seed (train split); `eval_fraction` holds out a fixed slice, or
`eval_path` names a separate file.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs

from peerflow.algorithms.base import Example, Task
from peerflow.errors import ConfigError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@attrs.frozen(kw_only=True)
class DatasetOptions:
    """`task.options` of `dataset`."""

    path: str
    """Local `.jsonl`, `.json`, `.parquet` or `.csv` file."""
    prompt_column: str = "prompt"
    """Column holding the prompt text."""
    answer_column: str = "answer"
    """Column holding the reference answer the reward compares against."""
    eval_path: str | None = None
    """Separate file for the eval split (same columns)."""
    eval_fraction: float = 0.0
    """Without `eval_path`: this fraction of rows (the last ones) is the eval split."""
    shuffle: bool = True
    """Shuffle the train split with the run's seed."""
    max_rows: int = 0
    """Use at most this many rows of the file (0: all)."""

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must lie in [0, 1), got {self.eval_fraction}.")


class DatasetTask(Task):
    """Any local dataset file, scored by `exact_match` unless `task.reward` says otherwise.

    Other choices: `contains`, `char_match`, or a plugin's reward.
    """

    name: ClassVar[str] = "dataset"
    options_class: ClassVar[type] = DatasetOptions
    default_reward: ClassVar[str] = "exact_match"

    def __init__(self, options: object | None = None) -> None:
        if options is None:
            raise ConfigError("task 'dataset' needs task.options.path (a local .jsonl/.parquet).")
        super().__init__(options)
        self._rows: dict[str, list[tuple[int, str, Any]]] = {}
        self._orders: dict[tuple[str, int], list[int]] = {}

    def _load(self, split: str) -> list[tuple[int, str, Any]]:
        if split not in ("train", "eval"):
            raise ValueError(f"task 'dataset' has splits 'train' and 'eval', not {split!r}.")
        if split not in self._rows:
            opts = self.options
            if opts.eval_path:
                rows = _read_rows(opts.eval_path if split == "eval" else opts.path, opts)
            else:
                rows = _read_rows(opts.path, opts)
                cut = len(rows) - int(round(len(rows) * opts.eval_fraction))
                rows = rows[cut:] if split == "eval" else rows[:cut]
            self._rows[split] = rows
        return self._rows[split]

    def size(self, split: str) -> int:
        """Rows in `split`."""
        return len(self._load(split))

    def _order(self, split: str, seed: int) -> list[int]:
        shuffle = split == "train" and self.options.shuffle
        key = (split, seed if shuffle else 0)
        if key not in self._orders:
            order = list(range(self.size(split)))
            if shuffle:
                random.Random(f"dataset:{seed}").shuffle(order)
            self._orders[key] = order
        return self._orders[key]

    def example(self, split: str, index: int, seed: int) -> Example:
        """Returns the `index`-th example of `split` in its seeded order."""
        rows = self._load(split)
        order = self._order(split, seed)
        row, prompt, answer = rows[order[index]]
        return Example(prompt=prompt, answer=answer, index=row)

    def examples(self, split: str, seed: int) -> Iterator[Example]:
        """Yields `split` in its seeded order; `Example.index` is the file's row number."""
        rows = self._load(split)
        for position in self._order(split, seed):
            row, prompt, answer = rows[position]
            yield Example(prompt=prompt, answer=answer, index=row)

    def metadata(self) -> dict[str, Any]:
        """Options plus the split sizes."""
        return {**attrs.asdict(self.options), "train_rows": self.size("train"),
                "eval_rows": self.size("eval")}


def _read_rows(path_text: str, opts: DatasetOptions) -> list[tuple[int, str, Any]]:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError(f"task.options.path: {str(path)!r} is not a file; give a local "
                          ".jsonl, .json, .parquet or .csv dataset.")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"task.options.path: {str(path)!r} has suffix {path.suffix!r}; "
                          f"expected one of {', '.join(FORMATS)}.")
    import datasets

    try:
        table = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - a parser error of any kind
        raise ConfigError(f"{path}: could not be read as {fmt}: {type(exc).__name__}: {exc}"
                          ) from None
    for option, column in (("prompt_column", opts.prompt_column),
                           ("answer_column", opts.answer_column)):
        if column not in table.column_names:
            raise ConfigError(
                f"{path}: has no column {column!r} (task.options.{option}); its columns are "
                f"{table.column_names}. Set task.options.{option} to one of them."
            )
    count = len(table) if not opts.max_rows else min(opts.max_rows, len(table))
    prompts = table[opts.prompt_column][:count]
    answers = table[opts.answer_column][:count]
    rows = []
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(
                f"{path}: row {row}: column {opts.prompt_column!r} is {prompt!r}; expected a "
                "non-empty string. Fix or drop the row."
            )
        if answer is None:
            raise ConfigError(
                f"{path}: row {row}: column {opts.answer_column!r} is empty (null); every row "
                "needs a reference answer. Fix or drop the row."
            )
        rows.append((row, prompt, answer))
    if not rows:
        raise ConfigError(f"{path}: has no rows.")
    return rows
