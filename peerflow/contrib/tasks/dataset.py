"""`dataset`: prompts and answers from a local file or `save_to_disk` directory.

The prompt column holds text, or a chat — a list of `{role, content}` messages, rendered
with the tokenizer's chat template (`add_generation_prompt`) — and `system_prompt`
prepends a system message. Columns may be nested (`answer_column:
reward_model.ground_truth`), so verl-style parquet loads as it is; every other column of
a row reaches function rewards in their `example` dict. Every row must have a prompt and
an answer; the first bad row is reported with its file, line (`.jsonl`) or row number
(1-based) and column. Rows are
shuffled by the run's seed (train split); `eval_fraction` holds out a fixed slice, or
`eval_path` names a separate file.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs

from peerflow.algorithms.base import Example, Task
from peerflow.contrib.tasks.datafiles import MISSING, column, read_labelled_rows
from peerflow.errors import ConfigError

#: One parsed row: (row number, prompt, answer, the row's other columns).
Row = tuple[int, "str | list[dict[str, str]]", Any, dict[str, Any]]
ROLES = ("system", "user", "assistant", "tool")


@attrs.frozen(kw_only=True)
class DatasetOptions:
    """`task.options` of `dataset`."""

    path: str
    """Local `.jsonl`, `.json`, `.parquet` or `.csv` file, or a `save_to_disk` directory."""
    prompt_column: str = "prompt"
    """Column holding the prompt: text, or a list of `{role, content}` messages."""
    answer_column: str = "answer"
    """Column holding the reference answer; dots address nested fields
    (`reward_model.ground_truth`)."""
    system_prompt: str | None = None
    """A system message put before every prompt (rows that start with one keep theirs)."""
    split: str = "train"
    """Split of a saved `DatasetDict` directory to train on."""
    eval_path: str | None = None
    """Separate file or directory for the eval split (same columns)."""
    eval_split: str | None = None
    """Split of a saved `DatasetDict` to evaluate on (e.g. `test`); instead of
    `eval_path` / `eval_fraction`."""
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
        self._rows: dict[str, list[Row]] = {}
        self._orders: dict[tuple[str, int], list[int]] = {}

    def _load(self, split: str) -> list[Row]:
        if split not in ("train", "eval"):
            raise ValueError(f"task 'dataset' has splits 'train' and 'eval', not {split!r}.")
        if split not in self._rows:
            opts = self.options
            if opts.eval_split:
                rows = _read_rows(opts.path, opts, opts.eval_split if split == "eval"
                                  else opts.split)
            elif opts.eval_path:
                rows = _read_rows(opts.eval_path if split == "eval" else opts.path, opts,
                                  opts.split)
            else:
                rows = _read_rows(opts.path, opts, opts.split)
                cut = len(rows) - int(round(len(rows) * opts.eval_fraction))
                rows = rows[cut:] if split == "eval" else rows[:cut]
                if split == "train" and not rows:
                    raise ConfigError(
                        f"{opts.path}: eval_fraction={opts.eval_fraction} leaves no rows to "
                        "train on; lower task.options.eval_fraction or add rows.")
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
        row, prompt, answer, metadata = rows[order[index]]
        return Example(prompt=prompt, answer=answer, index=row, metadata=metadata)

    def examples(self, split: str, seed: int) -> Iterator[Example]:
        """Yields `split` in its seeded order; `Example.index` is the file's row number."""
        rows = self._load(split)
        for position in self._order(split, seed):
            row, prompt, answer, metadata = rows[position]
            yield Example(prompt=prompt, answer=answer, index=row, metadata=metadata)

    def metadata(self) -> dict[str, Any]:
        """Options plus the split sizes."""
        return {**attrs.asdict(self.options), "train_rows": self.size("train"),
                "eval_rows": self.size("eval")}


def _prompt(value: Any, label: str, path: str, opts: DatasetOptions) -> Any:
    """Checks one prompt (text or messages) and adds the system prompt."""
    fix = f"{path}: {label}: column {opts.prompt_column!r} "
    if value is MISSING or value is None:
        raise ConfigError(fix + ("is missing" if value is MISSING else "is empty (null)")
                          + "; every row needs a prompt (a string or a list of {role, "
                          "content} messages). Fix or drop the row.")
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(fix + f"is {value!r}; expected a non-empty string or a list of "
                              "{role, content} messages. Fix or drop the row.")
        if opts.system_prompt is None:
            return value
        value = [{"role": "user", "content": value}]
    elif not isinstance(value, list) or not value:
        raise ConfigError(fix + f"is {value!r:.80}; expected a non-empty string or a list of "
                          "{role, content} messages. Fix or drop the row.")
    messages = []
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and message.get("role") in ROLES
                and isinstance(message.get("content"), str)):
            raise ConfigError(fix + f"message {i} is {message!r:.80}; each message needs a "
                              f"role ({', '.join(ROLES)}) and a string content.")
        messages.append({"role": message["role"], "content": message["content"]})
    if opts.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": opts.system_prompt})
    return messages


def _read_rows(path: str, opts: DatasetOptions, split: str) -> list[Row]:
    table = read_labelled_rows(path, split)
    if opts.max_rows:
        table = table[:opts.max_rows]
    first = table[0][1]
    for option, name in (("prompt_column", opts.prompt_column),
                         ("answer_column", opts.answer_column)):
        if column(first, name) is MISSING:
            raise ConfigError(
                f"{path}: has no column {name!r} (task.options.{option}); its columns are "
                f"{sorted(first)}. Set task.options.{option} to one of them (dots address "
                "nested fields, e.g. reward_model.ground_truth)."
            )
    rows = []
    for row, (label, record) in enumerate(table):
        answer = column(record, opts.answer_column)
        if answer is None or answer is MISSING:
            raise ConfigError(
                f"{path}: {label}: column {opts.answer_column!r} is "
                f"{'missing' if answer is MISSING else 'empty (null)'}; every row needs a "
                "reference answer. Fix or drop the row."
            )
        prompt = _prompt(column(record, opts.prompt_column), label, path, opts)
        metadata = {k: v for k, v in record.items() if k != opts.prompt_column}
        rows.append((row, prompt, answer, metadata))
    return rows
