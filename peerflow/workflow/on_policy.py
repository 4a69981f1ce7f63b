"""The on-policy fast path: whether a run needs the `old_logprob` node.

When the update is exactly on-policy — `runtime.mode: sync`, one mini-batch
(`trainer.mini_batches: 1`; `train_step` makes one pass over the batch) and the rollout
engine synced after every optimiser step (`weight_sync.every: 1`) — the trainer's
log-probs before the update are those of the weights being trained, so PPO's ratio is 1
by construction. The built-in GRPO graph then leaves out the `old_logprob` forward and
the loss takes the detached current log-probs as the proximal policy (see
`peerflow.algorithms.off_policy.CurrentProximal`). A custom graph (`workflow.nodes`)
gets exactly the nodes it lists.
"""

from __future__ import annotations

from typing import Any

import attrs

from peerflow.workflow.graph import WorkflowGraph

#: Built-in graphs whose `old_logprob` node the fast path may drop.
FAST_PATH_GRAPHS: tuple[str, ...] = ("grpo",)


def off_policy_reasons(config: Any) -> list[str]:
    """Why an update of `config` is not exactly on-policy (empty when it is)."""
    reasons = []
    if config.runtime.mode != "sync":
        reasons.append(f"runtime.mode={config.runtime.mode} (samples can be stale)")
    if config.trainer.mini_batches != 1:
        reasons.append(f"trainer.mini_batches={config.trainer.mini_batches} (every "
                       "mini-batch after the first is trained off-policy)")
    if config.weight_sync.every != 1:
        reasons.append(f"weight_sync.every={config.weight_sync.every} (the rollout engine "
                       "samples with older weights)")
    return reasons


@attrs.frozen(kw_only=True)
class OldLogprobDecision:
    """Whether the run's graph recomputes `old_logprobs`, and why."""

    kept: bool
    """Whether the graph has an `old_logprob` node."""
    reason: str
    """Why, in words."""

    def describe(self) -> str:
        """One line for `peerflow plan`."""
        return f"old_logprob {'kept' if self.kept else 'dropped'}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `peerflow plan --format json`."""
        return {"kept": self.kept, "reason": self.reason}


def old_logprob_decision(config: Any, graph: WorkflowGraph) -> OldLogprobDecision:
    """Explains whether `graph` (built from `config`) has an `old_logprob` node."""
    kept = "old_logprob" in graph.kinds()
    name = config.workflow.graph_name
    if name is None:
        listed = "lists an" if kept else "has no"
        return OldLogprobDecision(kept=kept, reason=f"workflow.nodes {listed} old_logprob node")
    if not kept:
        return OldLogprobDecision(
            kept=False, reason="on-policy (1 mini-batch, 1 epoch, sync every step)")
    reasons = off_policy_reasons(config)
    if name not in FAST_PATH_GRAPHS:
        reasons.append(f"workflow.graph={name} always recomputes it")
    return OldLogprobDecision(kept=True, reason="; ".join(reasons))
