"""`rollout.agent.options` of `agent-program`: the policy endpoint's settings.

Validated with the config, before any worker starts: the agent function loads, a host
beyond loopback has a bearer token, the `n` cap is not negative.
"""

from __future__ import annotations

import os

import attrs

from peerflow.distributed.listen import is_loopback


def _loadable(_: object, attribute: attrs.Attribute, value: str) -> None:
    from peerflow.rewards.loading import load_function, parse_target

    target = parse_target(value)
    if target is None:
        raise ValueError(f"rollout.agent.options.function={value!r}: name the agent function "
                         "as path/to/agent.py:function or package.module:function.")
    load_function(target, "rollout.agent.options.function")


@attrs.frozen(kw_only=True)
class AgentProgramOptions:
    """`rollout.agent.options` of `agent-program`."""

    function: str = attrs.field(validator=_loadable)
    """`path/to/agent.py:run_episode` or `package.module:run_episode`."""
    host: str = "127.0.0.1"
    """Address the endpoint listens on; anything but loopback needs `token_env`."""
    port: int = 0
    """Port (0: a free one; each rollout process serves its own episodes)."""
    token_env: str = ""
    """Environment variable holding the bearer token; empty: a random token per run
    process, handed to each episode as its `api_key`."""
    model_name: str = "policy"
    """The model id the endpoint serves (`/v1/models`, `model=` of each call)."""
    wait_s: float = 25.0
    """Seconds to wait for the program's next call (or its return); keep it below
    `rollout.agent.step_timeout_s` (default 30)."""
    cut_reward: float = 0.0
    """Reward of an episode a `rollout.agent` limit cut whose program then raised."""
    max_n: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Most choices (`n`) one call may ask for; more is answered 400 (0: the `n` the pass
    samples with: `rollout.sampling.n` in training, 1 in the greedy evaluation pass,
    `eval.n` in the sampled one). Every choice is a sample the trainer trains on; set it
    for a program that asks for choices."""

    def __attrs_post_init__(self) -> None:
        if not is_loopback(self.host) and not self.token_env:
            raise ValueError(
                f"rollout.agent.options.host={self.host!r} serves the policy beyond this "
                "machine; set rollout.agent.options.token_env to an environment variable "
                "holding a bearer token (or keep host 127.0.0.1).")
        if self.token_env and not os.environ.get(self.token_env):
            raise ValueError(f"rollout.agent.options.token_env={self.token_env!r}: that "
                             "environment variable is not set (it holds the bearer token).")
