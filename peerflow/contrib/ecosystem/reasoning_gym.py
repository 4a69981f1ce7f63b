"""`reasoning-gym`: prompts and scoring from the reasoning-gym library (its 100+ families).

`task.options` picks one family (`dataset: leg_counting`, its `config` passed through to
`reasoning_gym.create_dataset`) or a weighted composite (`datasets: [{name, weight,
config}, …]`). Example `i` of the train split is item `i` of the library's dataset built
with the train seed (`seed`, default the run's); the eval split is the same dataset built
with `eval_seed`, so held-out prompts differ from training ones and are the same in every
run.

The reward (`reasoning_gym`, the task's default) is the dataset's own `score_answer`: the
answer is extracted from the response (the last `<answer>…</answer>` by default, as the
library's system prompts ask; `answer_format: raw` scores the whole response), and the
dataset, rebuilt from the example's recorded spec inside the reward pool's process, scores
it against the item in [0, 1]. The library's data ships in its wheel: nothing is
downloaded.
"""

from __future__ import annotations

import functools
import json
import string
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs

from peerflow.algorithms.base import Example, Task
from peerflow.contrib.tasks.rewards import FunctionBackedReward

#: The top-level module and the extra that installs it (`config validate` names them).
MODULE, EXTRA = "reasoning_gym", "reasoning-gym"
#: Where an example keeps what the reward needs (`Example.metadata` key).
META_KEY = "reasoning_gym"
#: The characters of the tiny model `model.builder: reasoning-gym` builds.
ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"


def _known_family(_: object, attribute: attrs.Attribute, value: str) -> None:
    """Checks a family name against the library when it is installed.

    Without the library, `config validate` reports the missing extra instead.
    """
    if not value:
        return
    import importlib.util

    if importlib.util.find_spec(MODULE) is None:
        return
    from reasoning_gym.factory import DATASETS

    if value not in DATASETS:
        import difflib

        close = difflib.get_close_matches(value, list(DATASETS), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"reasoning-gym has no dataset {value!r}.{hint} Its "
                         f"{len(DATASETS)} families: python -c 'import reasoning_gym."
                         "factory as f; print(sorted(f.DATASETS))'.")


@attrs.frozen(kw_only=True)
class FamilySpec:
    """One family of a composite: `{name, weight, config}`."""

    name: str = attrs.field(validator=_known_family)
    """The reasoning-gym dataset name (`leg_counting`, `chain_sum`, …)."""
    weight: float = 1.0
    """Its share of the composite's items."""
    config: dict[str, Any] = attrs.field(factory=dict)
    """Passed to the family's config class (its difficulty settings)."""


@attrs.frozen(kw_only=True)
class ReasoningGymOptions:
    """`task.options` of `reasoning-gym`."""

    dataset: str = attrs.field(default="", validator=_known_family)
    """One family (`leg_counting`); or set `datasets` for a weighted composite."""
    config: dict[str, Any] = attrs.field(factory=dict)
    """Options of `dataset`'s config class (passed through, checked by the library)."""
    datasets: list[FamilySpec] = attrs.field(factory=list)
    """A weighted composite of families (instead of `dataset`)."""
    train_size: int = attrs.field(default=1000, validator=attrs.validators.gt(0))
    """Items in one epoch of the train split."""
    eval_size: int = attrs.field(default=100, validator=attrs.validators.gt(0))
    """Items in the eval split."""
    seed: int | None = None
    """Seed of the train split's items; `None`: the run's seed."""
    eval_seed: int = 1_000_003
    """Seed of the eval split's items (the same held-out prompts in every run)."""
    system_prompt: str = "default"
    """A name of `reasoning_gym.utils.SYSTEM_PROMPTS` (`default`, `simple`, `direct`,
    `DeepSeekZero`, `chain_of_draft`), any other text (used as it is), or `""` for none —
    then the prompt is the bare question (for a tokenizer without a chat template)."""
    answer_format: str = attrs.field(
        default="tags", validator=attrs.validators.in_(("tags", "raw")))
    """`tags`: score the last `<answer>…</answer>` of the response (none: 0); `raw`: the
    whole response, stripped."""

    def __attrs_post_init__(self) -> None:
        if bool(self.dataset) == bool(self.datasets):
            raise ValueError("task.options: set dataset (one reasoning-gym family, e.g. "
                             "leg_counting) or datasets (a weighted list), exactly one.")
        families = [(self.dataset, self.config)] if self.dataset else [
            (d.name, d.config) for d in self.datasets]
        for name, config in families:
            check_family_config(name, config)


def check_family_config(name: str, config: dict[str, Any]) -> None:
    """Builds the family's config class from `config` (when the library is installed).

    Raises:
        ValueError: an unknown option or a value the library's own `validate()` refuses.
    """
    import importlib.util

    if importlib.util.find_spec(MODULE) is None:
        return
    import dataclasses

    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[name][1]
    known = [f.name for f in dataclasses.fields(config_cls)] if dataclasses.is_dataclass(
        config_cls) else []
    unknown = sorted(set(config) - set(known)) if known else []
    if unknown:
        raise ValueError(f"reasoning-gym's {name} has no option {', '.join(unknown)}; its "
                         f"options: {', '.join(k for k in known if k not in ('seed', 'size'))}.")
    try:
        built = config_cls(**config)
        if hasattr(built, "validate"):
            built.validate()
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning-gym's {name} refuses config {config}: "
                         f"{type(exc).__name__}: {exc}") from exc


def dataset_spec(options: ReasoningGymOptions, size: int, seed: int) -> dict[str, Any]:
    """The JSON-able arguments of `reasoning_gym.create_dataset` for one split."""
    if options.dataset:
        return {"name": options.dataset, "size": size, "seed": seed,
                "config": dict(options.config)}
    parts = [{"name": d.name, "weight": d.weight, "config": dict(d.config)}
             for d in options.datasets]
    return {"name": "composite", "size": size, "seed": seed, "datasets": parts}


@functools.lru_cache(maxsize=64)
def _build(spec_json: str) -> Any:
    import reasoning_gym

    spec = json.loads(spec_json)
    if spec["name"] != "composite":
        return reasoning_gym.create_dataset(spec["name"], size=spec["size"], seed=spec["seed"],
                                            **spec["config"])
    from reasoning_gym.composite import DatasetSpec

    families = [DatasetSpec(d["name"], d["weight"], d["config"]) for d in spec["datasets"]]
    return reasoning_gym.create_dataset("composite", size=spec["size"], seed=spec["seed"],
                                        datasets=families)


def build_dataset(spec: dict[str, Any]) -> Any:
    """The library's dataset for `spec` (cached per process; building it is lazy)."""
    return _build(json.dumps(spec, sort_keys=True))


def system_prompt(name_or_text: str) -> str:
    """The system prompt `system_prompt` names (a library prompt's name, or literal text)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


class ReasoningGymTask(Task):
    """Items of a reasoning-gym family (or composite) as prompts; scored by the library."""

    name: ClassVar[str] = "reasoning-gym"
    options_class: ClassVar[type] = ReasoningGymOptions
    default_reward: ClassVar[str] = "reasoning_gym"
    requires: ClassVar[tuple[str, ...]] = (MODULE,)
    extra: ClassVar[str] = EXTRA

    def size(self, split: str) -> int:
        """`train_size` or `eval_size`."""
        return self.options.train_size if _split(split) == "train" else self.options.eval_size

    def spec(self, split: str, seed: int) -> dict[str, Any]:
        """The dataset spec of `split` (train: `options.seed` or `seed`; eval: `eval_seed`)."""
        if _split(split) == "eval":
            return dataset_spec(self.options, self.options.eval_size, self.options.eval_seed)
        own = self.options.seed if self.options.seed is not None else seed
        return dataset_spec(self.options, self.options.train_size, own)

    def example(self, split: str, index: int, seed: int) -> Example:
        """Returns item `index` of `split` (a direct lookup)."""
        size = self.size(split)
        if not 0 <= index < size:
            raise IndexError(f"task 'reasoning-gym' split {split!r} has {size} examples; "
                             f"index {index} is out of range.")
        spec = self.spec(split, seed)
        item = build_dataset(spec)[index]
        prompt: str | list[dict[str, str]] = item["question"]
        if self.options.system_prompt:
            prompt = [{"role": "system", "content": system_prompt(self.options.system_prompt)},
                      {"role": "user", "content": item["question"]}]
        meta = {"spec": spec, "index": index, "answer_format": self.options.answer_format,
                "question": item["question"], "metadata": item["metadata"]}
        return Example(prompt=prompt, answer=item["answer"], index=index,
                       metadata={META_KEY: meta})

    def examples(self, split: str, seed: int) -> Iterator[Example]:
        """Yields every item of `split` in index order."""
        for index in range(self.size(split)):
            yield self.example(split, index, seed)

    @classmethod
    def check_builder_options(cls, options: Mapping[str, Any]) -> list[str]:
        """Validates `model.builder_options` against `TinyModelOptions`."""
        from peerflow.contrib.tasks.tiny_model import builder_option_problems

        return builder_option_problems(options)

    @classmethod
    def build_model(cls, options: Mapping[str, Any], cache_dir: str | None = None) -> str:
        """A tiny Llama with a character tokenizer over printable ASCII (`model.builder`).

        For CPU runs on families with short questions (`chain_sum`, `products` with one
        digit): warm it up with `peerflow sft`, then train with GRPO (docs/environments.md).
        """
        from peerflow.contrib.tasks.tiny_model import build_tiny_model, options_from_mapping

        return str(build_tiny_model("reasoning-gym", [ALPHABET], options_from_mapping(options),
                                    cache_dir))


def _split(split: str) -> str:
    if split not in ("train", "eval"):
        raise ValueError(f"task 'reasoning-gym' has splits 'train' and 'eval', not {split!r}.")
    return split


def extract(response: str, answer_format: str) -> str | None:
    """The answer a response gives: its last `<answer>…</answer>` (`tags`), or all of it."""
    if answer_format == "raw":
        return response.strip()
    from reasoning_gym.utils import extract_answer

    return extract_answer(response)


def reasoning_gym_reward(response: str, example: dict[str, Any]) -> float:
    """Scores `response` with its dataset's own `score_answer` (in [0, 1]).

    Runs in the reward pool: the dataset is rebuilt (once per process) from the spec the
    task recorded in the example, and scores the library's own item.
    """
    meta = example.get(META_KEY)
    if not isinstance(meta, dict):
        raise ValueError("the reasoning_gym reward scores examples of task.name: "
                         "reasoning-gym only (this example has no reasoning-gym item); use "
                         "another task.reward for other tasks.")
    entry = {"question": meta["question"], "answer": example["answer"],
             "metadata": meta["metadata"]}
    answer = extract(response, meta["answer_format"])
    return float(build_dataset(meta["spec"]).score_answer(answer, entry))


class ReasoningGymReward(FunctionBackedReward):
    """The reasoning-gym dataset's own `score_answer`, run in the reward pool."""

    name: ClassVar[str] = "reasoning_gym"
    function: ClassVar[str] = "peerflow.contrib.ecosystem.reasoning_gym:reasoning_gym_reward"
    requires: ClassVar[tuple[str, ...]] = (MODULE,)
    extra: ClassVar[str] = EXTRA
