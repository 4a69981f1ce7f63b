"""Reading a local dataset into rows, with errors that name the file, line and fix.

* `.jsonl` is read line by line with `json`, so a bad byte or a malformed line is
  reported with its line number (and column) rather than from inside a parser;
* `.json`, `.parquet`, `.csv` go through Hugging Face `datasets` (verl-style parquet —
  `prompt` as a list of messages, `reward_model: {ground_truth}`, `data_source`,
  `extra_info` — loads as it is);
* a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` loads with
  `datasets.load_from_disk` (a `DatasetDict` gives its splits).

`column(row, "reward_model.ground_truth")` addresses nested fields.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from peerflow.errors import ConfigError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

#: A missing nested column.
MISSING = object()


def column(row: Mapping[str, Any], name: str) -> Any:
    """The value of `name` in `row`; dots step into nested mappings (`MISSING` if absent)."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The rows of a .jsonl file with their 1-based line numbers (blank lines skipped)."""
    rows = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{path}: line {number}: byte {raw[exc.start:exc.start + 1]!r} at column "
                    f"{exc.start + 1} is not UTF-8. Re-encode the file as UTF-8 (e.g. "
                    f"`iconv -f latin1 -t utf-8 {path.name}`) or fix that line."
                ) from None
            if not line.strip():
                continue
            try:  # without its line break, a line cut short is named at its end, not at
                row = json.loads(line.rstrip("\r\n"))  # column 1 of a next line
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{path}: line {number}, column {exc.pos + 1}: not valid JSON ({exc.msg}); "
                    "every line of a .jsonl file must be one JSON object. Fix or delete "
                    "that line."
                ) from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}: line {number}: is a JSON {type(row).__name__}, "
                                  "not an object; write one {\"prompt\": ..., \"answer\": ...} "
                                  "object per line.")
            rows.append((number, row))
    return rows


def _read_with_datasets(path: Path, fmt: str) -> list[dict[str, Any]]:
    import datasets

    try:
        table = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: byte {exc.object[exc.start:exc.start + 1]!r} at offset "
                          f"{exc.start} is not UTF-8; re-encode the file as UTF-8.") from None
    except Exception as exc:  # noqa: BLE001 - a parser error of any kind
        raise ConfigError(f"{path}: could not be read as {fmt}: {type(exc).__name__}: {exc}"
                          ) from None
    return table.to_list()


def _read_directory(path: Path, split: str) -> list[dict[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(
            f"task.options.path: {str(path)!r} is a directory but not one written by "
            f"`Dataset.save_to_disk` ({type(exc).__name__}: {exc}); point it at such a "
            "directory or at a .jsonl/.parquet file."
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"{path}: has splits {sorted(loaded)}, not {split!r}; set "
                              "task.options.split (or eval_split) to one of them.")
        loaded = loaded[split]
    return loaded.to_list()


def read_rows(path_text: str, split: str = "train") -> list[dict[str, Any]]:
    """Reads every row of a local dataset file or `save_to_disk` directory.

    Same as `read_labelled_rows` without the labels.
    """
    return [row for _label, row in read_labelled_rows(path_text, split)]


def read_labelled_rows(path_text: str, split: str = "train") -> list[tuple[str, dict[str, Any]]]:
    """Reads every row of a local dataset file or `save_to_disk` directory, with its label.

    A label is how messages name the row, counting from 1 as editors do: `line N` (the
    file's line) in a .jsonl file, `row N` elsewhere.

    Args:
        path_text: The file or directory (`~` expanded).
        split: Which split of a saved `DatasetDict` to read.

    Raises:
        ConfigError: missing path, unknown suffix, undecodable or malformed content, or no
            rows — naming the file, the line and the fix.
    """
    path = Path(path_text).expanduser()
    if path.is_dir():
        rows = _numbered(_read_directory(path, split))
    elif not path.is_file():
        raise ConfigError(f"task.options.path: {str(path)!r} is not a file; give a local "
                          ".jsonl, .json, .parquet or .csv dataset, or a save_to_disk "
                          "directory.")
    else:
        fmt = FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise ConfigError(f"task.options.path: {str(path)!r} has suffix {path.suffix!r}; "
                              f"expected one of {', '.join(FORMATS)} or a save_to_disk "
                              "directory.")
        rows = ([(f"line {n}", row) for n, row in _read_jsonl(path)]
                if path.suffix.lower() == ".jsonl" else
                _numbered(_read_with_datasets(path, fmt)))
    if not rows:
        raise ConfigError(f"{path}: the dataset is empty (no rows); add at least one row "
                          "with a prompt and an answer, or point task.options.path at "
                          "another file.")
    return rows


def _numbered(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"row {i}", row) for i, row in enumerate(rows, start=1)]
