"""textarena games as multi-turn environments (`task.name`, `rollout.agent.environment`).

Both are named `textarena`. The task (`task.options.env_id: GuessTheNumber-v0`) yields
one game per example: example `i` is the game `ta.make(env_id)` deals with seed
`(seed, split, i)`, its prompt the game's own opening prompt. The environment plays that
game with the model as player 0, token in and token out through the one agent driver
(`peerflow.agents.rollout`): each model turn is the action (`[5]`, as the game's prompt
asks), the game's new messages since the last turn are the observation (appended as
tokens, masked out of the loss — never the whole history re-rendered, which textarena's
`LLMObservationWrapper` would do), and the game's reward for player 0 from `close()` is
the outcome reward.

Single-player games only (the model plays player 0 of a one-player game); the number,
puzzle and board games are pure Python. Games that read data downloaded at run time (word
games: nltk word lists) or call a model themselves are refused at `config validate`, as
are multi-player games.

textarena seeds Python's global `random` and draws from it during play; each game here
keeps its own `random` state, swapped in (under a lock) for each of its calls, so games
stepping at once on the driver's threads stay deterministic and the process's own `random`
is untouched.
"""

from __future__ import annotations

import importlib.util
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs

from peerflow.agents.environment import Environment, StepResult, Turn
from peerflow.algorithms.base import Example, Task

MODULE, EXTRA = "textarena", "textarena"
META_KEY = "textarena"
#: What marks a game that needs the network or downloaded data, in its package's source.
_ONLINE = re.compile(r"\bnltk\b|\.download\(|\brequests\b|\burllib\b|\bopenai\b|"
                     r"OpenRouter|load_dataset|envs\.utils\.(?:jury|word_lists)")
_RANDOM = threading.Lock()


def _game_problem(env_id: str) -> str | None:
    """Why `env_id` cannot be played here (unknown, online, multi-player), else `None`."""
    if importlib.util.find_spec(MODULE) is None:
        return None  # config validate reports the missing extra
    from textarena.envs.registration import ENV_REGISTRY

    spec = ENV_REGISTRY.get(env_id)
    if spec is None:
        import difflib

        close = difflib.get_close_matches(env_id, list(ENV_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        return f"textarena has no game {env_id!r}.{hint}"
    module = spec.entry_point.split(":")[0] if isinstance(spec.entry_point, str) else (
        spec.entry_point.__module__)
    root = Path(importlib.util.find_spec(MODULE).origin).parent  # no game is imported
    folder = root.joinpath(*module.split(".")[1:]).parent
    sources = sorted(folder.rglob("*.py")) if folder.is_dir() else []
    if any(_ONLINE.search(p.read_text(errors="replace")) for p in sources):
        return (f"textarena game {env_id!r} downloads data (word lists) or calls a model at "
                "run time, which a training machine without network cannot do; choose a "
                "number, puzzle or board game (GuessTheNumber-v0, FrozenLake-v0, "
                "TowerOfHanoi-v0, Minesweeper-v0, Sudoku-v0).")
    try:
        Game(env_id, seed=0)
    except Exception as exc:  # noqa: BLE001 — reported as the config's problem
        return (f"textarena game {env_id!r} cannot be started as a one-player game here "
                f"({type(exc).__name__}: {exc}); choose a single-player game that starts, "
                "e.g. GuessTheNumber-v0.")
    return None


def _playable(_: object, attribute: attrs.Attribute, value: str) -> None:
    problem = _game_problem(value)
    if problem:
        raise ValueError(problem)


class Game:
    """One textarena game with its own `random` state; the model is player 0."""

    def __init__(self, env_id: str, seed: int) -> None:
        import textarena as ta

        wrapped = ta.make(env_id)
        raw = wrapped
        while hasattr(raw, "env"):  # strip the wrappers: the driver renders turns itself
            raw = raw.env
        self.env = raw
        self._state = random.Random(seed).getstate()
        self._call(self.env.reset, num_players=1, seed=seed)
        self.done = False
        self.rewards: dict[int, float] | None = None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with _RANDOM:
            outer = random.getstate()
            random.setstate(self._state)
            try:
                return fn(*args, **kwargs)
            finally:
                self._state = random.getstate()
                random.setstate(outer)

    def messages(self) -> list[str]:
        """The game's messages to player 0 since the last call (its own actions left out)."""
        player, messages = self._call(self.env.get_observation)
        if player != 0:
            raise RuntimeError(f"textarena game expects player {player}; PeerFlow plays "
                               "single-player games only.")
        return [text for sender, text, _ in messages if sender != 0]

    def act(self, action: str) -> bool:
        """Plays `action`; returns whether the game is over (then `rewards` is set)."""
        done, _ = self._call(self.env.step, action)
        if done:
            self.done = True
            self.rewards, _ = self._call(self.env.close)
        return bool(done)


@attrs.frozen(kw_only=True)
class TextArenaTaskOptions:
    """`task.options` of `textarena`."""

    env_id: str = attrs.field(validator=_playable)
    """The textarena game id (`GuessTheNumber-v0`, `FrozenLake-v0`, …)."""
    train_size: int = attrs.field(default=10_000, validator=attrs.validators.gt(0))
    """Games in one epoch of the train split."""
    eval_size: int = attrs.field(default=64, validator=attrs.validators.gt(0))
    """Games in the eval split (the same in every run)."""


class TextArenaTask(Task):
    """Games of one textarena id, each dealt by its own seed; prompt = the game's prompt."""

    name: ClassVar[str] = "textarena"
    options_class: ClassVar[type] = TextArenaTaskOptions
    default_reward: ClassVar[str] = "exact_match"  # unused: the environment scores games
    requires: ClassVar[tuple[str, ...]] = (MODULE,)
    extra: ClassVar[str] = EXTRA

    def size(self, split: str) -> int:
        """`train_size` or `eval_size`."""
        return self.options.train_size if split == "train" else self.options.eval_size

    def example(self, split: str, index: int, seed: int) -> Example:
        """The game of `split` number `index`: its seed and opening prompt."""
        if split not in ("train", "eval"):
            raise ValueError(f"task 'textarena' has splits 'train' and 'eval', not {split!r}.")
        if not 0 <= index < self.size(split):
            raise IndexError(f"task 'textarena' split {split!r} has {self.size(split)} "
                             f"examples; index {index} is out of range.")
        game_seed = random.Random(f"textarena:{split}:{0 if split == 'eval' else seed}:"
                                  f"{index}").randrange(2**31)
        prompt = "\n".join(Game(self.options.env_id, game_seed).messages())
        return Example(prompt=prompt, index=index, metadata={
            META_KEY: {"env_id": self.options.env_id, "seed": game_seed}})

    def examples(self, split: str, seed: int) -> Iterator[Example]:
        """Yields every game of `split` in index order."""
        for index in range(self.size(split)):
            yield self.example(split, index, seed)


@attrs.frozen(kw_only=True)
class TextArenaOptions:
    """`rollout.agent.options` of the `textarena` environment."""

    unfinished_reward: float = 0.0
    """The outcome reward of a game still open when a `rollout.agent` limit ends it."""
    system_prompt: str = ""
    """A system message before the game's prompt (needs a chat template)."""


class TextArenaEnvironment(Environment):
    """Plays the example's textarena game; the model is player 0 of a one-player game."""

    name: ClassVar[str] = "textarena"
    options_class: ClassVar[type] = TextArenaOptions
    requires: ClassVar[tuple[str, ...]] = (MODULE,)
    extra: ClassVar[str] = EXTRA

    def __init__(self, example: Example, options: TextArenaOptions) -> None:
        super().__init__(example, options)
        meta = example.metadata.get(META_KEY)
        if not isinstance(meta, dict):
            raise ValueError("rollout.agent.environment: textarena plays the games of "
                             "task.name: textarena; set task.name: textarena with "
                             "task.options.env_id.")
        self.game = Game(meta["env_id"], meta["seed"])
        self.opening = "\n".join(self.game.messages())

    def initial_prompt(self) -> str | list[dict[str, str]]:
        """The game's opening prompt (after `system_prompt` when set)."""
        if not self.options.system_prompt:
            return self.opening
        return [{"role": "system", "content": self.options.system_prompt},
                {"role": "user", "content": self.opening}]

    def step(self, turn: Turn) -> StepResult:
        """Plays the model's turn as player 0's action; the game's answer is the observation."""
        if self.game.act(turn.text):
            reward = (self.game.rewards or {}).get(0)
            return StepResult(done=True, info={"won": float(bool(reward and reward > 0))})
        return StepResult(observation="\n".join(self.game.messages()))

    def final_reward(self) -> float:
        """The game's reward for player 0 (`unfinished_reward` while the game is open)."""
        if not self.game.done or not self.game.rewards:
            return float(self.options.unfinished_reward)
        return float(self.game.rewards.get(0, self.options.unfinished_reward))
