"""Packing finished trajectories into a batch, and the agent fields of that batch.

`pack_trajectories` is the last step of the driver (`peerflow.agents.rollout`): one
sample per trajectory (restart and branch segments included), with the fields of
`peerflow.rollout.generate.generate_batch` plus the agent's own (loss mask, per-token
versions and rewards, the environment's outcome reward, turns, how and why it ended).
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

import torch

from peerflow.agents.routes import pack_routes
from peerflow.batch import LOSS_MASK, Batch, RaggedField
from peerflow.routes import ROUTES
from peerflow.streaming.versions import TOKEN_VERSIONS

#: Per sample: the named rewards `final_reward()` returned as a dict (their sum is the
#: outcome); they join the reward components (`reward/<name>/mean`, the samples' table).
ENV_REWARD_COMPONENTS = "env_reward_components"
#: Per sample: `{"type", "traceback"}` of what ended it as `env_error`/`env_timeout`
#: (empty for an episode that did not fail); written to `RUN_DIR/agent_errors.jsonl`.
AGENT_FAILURE = "agent_failure"
#: Sample ids of an episode's later samples (`StepResult.restart`): `segment` times this
#: plus the first sample's id, so they never meet the dense ids of first samples.
SEGMENT_STRIDE = 1 << 40


def failure_of(error: BaseException | None, kind: str = "") -> dict[str, str]:
    """What `agent_errors.jsonl` keeps of a failure: its type and traceback.

    Args:
        error: What was raised (`None`: a failure the driver found, e.g. diverging
            first prompts, which has no traceback).
        kind: The failure's type when there is no exception.
    """
    if error is None:
        return {"type": kind, "traceback": ""}
    return {"type": type(error).__name__,
            "traceback": "".join(traceback.format_exception(error)).rstrip()}


def pack_trajectories(trajectories: Sequence[Any], final: list[float],
                      named: list[dict[str, float]], n: int, version: int) -> Batch:
    """Packs finished trajectories (`peerflow.agents.rollout.Trajectory`) into a batch.

    Args:
        trajectories: Every sample of the call, in order.
        final: Each sample's outcome reward (NaN: the task's rewards score it).
        named: The named rewards the outcome is the sum of, per sample.
        n: The group size (sample ids are `position * n + index`, as `generate_batch`'s).
        version: The engine's weight version (for samples without tokens).
    """
    def ragged(rows: list[list[Any]], dtype: torch.dtype) -> RaggedField:
        return RaggedField.from_tensors([torch.tensor(r, dtype=dtype) for r in rows], dtype=dtype)

    ts = list(trajectories)
    versions = [t.versions or [version] for t in ts]
    batch = Batch(
        sample_id=torch.tensor([t.draw.position * n + t.index + t.segment * SEGMENT_STRIDE
                                for t in ts]),
        group_id=torch.tensor([t.draw.position for t in ts]),
        weight_version=torch.tensor([min(v) for v in versions], dtype=torch.int64),
    )
    batch.set("prompt_ids", ragged([t.prompt for t in ts], torch.int64))
    batch.set("response_ids", ragged([t.tokens for t in ts], torch.int64))
    batch.set("rollout_logprobs", ragged([t.logprobs for t in ts], torch.float32))
    batch.set(LOSS_MASK, ragged([t.mask for t in ts], torch.bool))
    batch.set(TOKEN_VERSIONS, ragged([t.versions for t in ts], torch.int64))
    batch.set("token_rewards", ragged([t.token_rewards for t in ts], torch.float32))
    routes = pack_routes(ts)  # MoE engines: prompt + response, -1 on observations
    if routes is not None:
        batch.set(ROUTES, routes)
    batch.set("env_reward", torch.tensor(final, dtype=torch.float32))
    batch.set_objects(ENV_REWARD_COMPONENTS, named)
    batch.set("num_turns", torch.tensor([t.turns for t in ts], dtype=torch.int64))
    batch.set_objects("finish_reason", [t.finish for t in ts])
    batch.set_objects("agent_error", [t.error for t in ts])
    batch.set_objects(AGENT_FAILURE, [dict(t.failure) for t in ts])
    batch.set_objects("agent_info", [t.info for t in ts])
    batch.set_objects("example", [t.draw.example for t in ts])
    return batch
