"""`NodeContext`: what a workflow node sees on a rank — the built-in kinds and a plugin's alike.

A node's `run(batch, context)` reaches the rank's engines by role, the run's rewards and
algorithm, its role's process group, this rank's share of the prompts and generation,
the weight sync, the step and its metrics, and its own options; nothing else of the
worker. `WorkerRuntime.node_context` builds one per node run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from peerflow.worker.metrics import StepMetrics


@attrs.frozen(kw_only=True)
class NodeContext:
    """What a node sees on a rank: engines by role, rewards, the step, its options."""

    node: Any
    """The workflow `Node` being run (name, role, inputs, outputs, `options`)."""
    step: int
    """The step being run (1-based)."""
    metrics: StepMetrics
    """This rank's metrics of the step (`mean`, `sum`, `max`, `min`)."""
    config: Any
    """The run's `RunConfig` (read-only)."""
    algorithm: Any
    """The run's `peerflow.algorithms.Algorithm` (estimator, losses, reward shaping)."""
    rank: int
    """This process's global rank."""
    dp_rank: int
    """This rank's index among the prompt readers (0 on a rank that reads none)."""
    dp_size: int
    """Number of prompt readers (dp-ranks of the `generate` role)."""
    run_dir: Path
    """The run directory every rank writes into."""
    tokenizer: Any
    """The model's tokenizer (decodes answers for rewards)."""
    engine: Callable[[str], Any]
    """`engine(role)`: this rank's engine of `role` (`rollout`, `actor`, `ref`, `critic`,
    or any role of `peerflow.workflow.roles.ROLES`); a role not hosted here raises."""
    rewards: Callable[..., Any]
    """`rewards(name=None)`: the `RewardSet` called `name`, or the run's (`task.reward` /
    `task.rewards`), built on first use."""
    process_group: Callable[[str], Any]
    """`process_group(role)`: the torch.distributed group of `role`'s ranks (`None` when
    this rank does not host it)."""
    prompts: Any
    """This dp-rank's `ShardedPromptSampler` (`draw(count)`)."""
    generate: Callable[[Any, Any], Any]
    """`generate(draws, sampling)`: a batch of answers (agent episodes with
    `rollout.agent`) from this rank's rollout engine, inside the weight sync's time
    sharing."""
    sync_weights: Callable[[], Any]
    """`sync_weights()`: one trainer → rollout weight sync, every rank of it together;
    returns this rank's `WeightSyncStats` (`None` outside the sync)."""
    progress: Any = None
    """The step progress bar (`peerflow.outputs.StepProgress`), or `None`."""
    max_refill_rounds: int = 4
    """Dynamic sampling's bound on refill rounds a step (DAPO)."""

    @property
    def options(self) -> Mapping[str, Any]:
        """The node's `options` from the workflow config."""
        return self.node.options
