"""Generated verifiable tasks: `reverse-digits` and `arithmetic`.

Example `i` of a split is drawn from its own random stream seeded by
`(task, split, seed, i)`, so `examples(split, seed)` is deterministic and
`example(split, i, seed)` is a direct lookup — a resumed run replays the same prompts.
The `eval` split ignores `seed` (the same held-out prompts in every run).

Prompts are bare and short, as a tiny character-level model wants them: `"4071>"`
asks for `"1704"`, `"12+345="` asks for `"357"`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs

from peerflow.algorithms.base import Example, Task

#: Every character the generated tasks use; the tiny tokenizer covers exactly these.
ALPHABET = "0123456789+=> "


class GeneratedTask(Task):
    """A task whose examples come from a seeded generator; subclasses define `make`."""

    default_reward: ClassVar[str] = "char_match"
    alphabet: ClassVar[str] = ALPHABET
    """Every character of its prompts and answers (the tiny tokenizer's vocabulary);
    empty for a task meant for a real model (no `model.builder`)."""

    def size(self, split: str) -> int:
        """`train_size` or `eval_size` from the options."""
        _check_split(split, self.name)
        return self.options.train_size if split == "train" else self.options.eval_size

    def example(self, split: str, index: int, seed: int) -> Example:
        """Returns example `index` of `split` directly (no iteration)."""
        size = self.size(split)
        if not 0 <= index < size:
            raise IndexError(f"task {self.name!r} split {split!r} has {size} examples; "
                             f"index {index} is out of range.")
        stream_seed = 0 if split == "eval" else seed
        rng = random.Random(f"{self.name}:{split}:{stream_seed}:{index}")
        prompt, answer = self.make(rng)
        return Example(prompt=prompt, answer=answer, index=index)

    def examples(self, split: str, seed: int) -> Iterator[Example]:
        """Yields every example of `split` in index order."""
        for index in range(self.size(split)):
            yield self.example(split, index, seed)

    def make(self, rng: random.Random) -> tuple[str, str]:
        """Returns one `(prompt, answer)` drawn from `rng`."""
        raise NotImplementedError

    @classmethod
    def check_builder_options(cls, options: Mapping[str, Any]) -> list[str]:
        """Validates `model.builder_options` against `TinyModelOptions`."""
        if not cls.alphabet:
            return super().check_builder_options(options)
        from peerflow.contrib.tasks.tiny_model import builder_option_problems

        return builder_option_problems(options)

    @classmethod
    def build_model(cls, options: Mapping[str, Any], cache_dir: str | None = None) -> str:
        """Builds the tiny Llama + character tokenizer covering `alphabet` (cached)."""
        if not cls.alphabet:
            return super().build_model(options, cache_dir)
        from peerflow.contrib.tasks.tiny_model import build_tiny_model, options_from_mapping

        path = build_tiny_model("digits", [cls.alphabet], options_from_mapping(options),
                                cache_dir)
        return str(path)


def _check_split(split: str, task: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"task {task!r} has splits 'train' and 'eval', not {split!r}.")


def _digits(rng: random.Random, count: int, leading_zero: bool) -> str:
    first = rng.choice("0123456789" if leading_zero else "123456789")
    return first + "".join(rng.choice("0123456789") for _ in range(count - 1))


@attrs.frozen(kw_only=True)
class ReverseDigitsOptions:
    """`task.options` of `reverse-digits`."""

    digits: int = attrs.field(default=3, validator=attrs.validators.gt(0))
    """Longest digit string."""
    min_digits: int = 0
    """Shortest digit string (0: always `digits`)."""
    train_size: int = attrs.field(default=100_000, validator=attrs.validators.gt(0))
    """Examples in one epoch of the train split."""
    eval_size: int = attrs.field(default=256, validator=attrs.validators.gt(0))
    """Examples in the eval split."""

    def __attrs_post_init__(self) -> None:
        if self.min_digits > self.digits:
            raise ValueError(f"min_digits={self.min_digits} exceeds digits={self.digits}.")


class ReverseDigitsTask(GeneratedTask):
    """Reverse a string of digits: `"4071>"` → `"1704"` (partial credit by position)."""

    name: ClassVar[str] = "reverse-digits"
    options_class: ClassVar[type] = ReverseDigitsOptions

    def make(self, rng: random.Random) -> tuple[str, str]:
        """Returns `(digits + ">", reversed digits)`."""
        count = rng.randint(self.options.min_digits or self.options.digits, self.options.digits)
        text = _digits(rng, count, leading_zero=True)
        return f"{text}>", text[::-1]


@attrs.frozen(kw_only=True)
class ArithmeticOptions:
    """`task.options` of `arithmetic`."""

    digits: int = attrs.field(default=3, validator=attrs.validators.gt(0))
    """Digits of each operand (no leading zeros)."""
    operands: int = attrs.field(default=2, validator=attrs.validators.gt(0))
    """Numbers added together."""
    no_carry: bool = False
    """Only sums without any carry (an easy distribution for a warm start)."""
    train_size: int = attrs.field(default=100_000, validator=attrs.validators.gt(0))
    """Examples in one epoch of the train split."""
    eval_size: int = attrs.field(default=256, validator=attrs.validators.gt(0))
    """Examples in the eval split."""

    def __attrs_post_init__(self) -> None:
        if self.no_carry and self.operands > 9:
            raise ValueError("no_carry needs at most 9 operands (one digit column ≤ 9).")


class ArithmeticTask(GeneratedTask):
    """Multi-digit addition: `"12+345="` → `"357"` (partial credit; `exact_match` too)."""

    name: ClassVar[str] = "arithmetic"
    options_class: ClassVar[type] = ArithmeticOptions

    def make(self, rng: random.Random) -> tuple[str, str]:
        """Returns `("a+b=", str(a + b))`."""
        opts = self.options
        if opts.no_carry:
            numbers = _no_carry_operands(rng, opts.digits, opts.operands)
        else:
            numbers = [int(_digits(rng, opts.digits, leading_zero=False))
                       for _ in range(opts.operands)]
        return "+".join(map(str, numbers)) + "=", str(sum(numbers))


def _no_carry_operands(rng: random.Random, digits: int, operands: int) -> list[int]:
    """Operands whose every digit column sums to at most 9 (leading digits non-zero)."""
    columns = []
    for position in range(digits):
        low = 1 if position == 0 else 0
        column, used = [], 0
        for k in range(operands):
            high = 9 - used - low * (operands - k - 1)
            column.append(rng.randint(low, high))
            used += column[-1]
        rng.shuffle(column)
        columns.append(column)
    return [int("".join(str(col[k]) for col in columns)) for k in range(operands)]
