"""The proximal fast path: whether a run needs the `old_logprob` node.

Decoupled PPO takes its ratio against the proximal policy `π_prox`, the trainer's weights
before the update, and corrects for the behaviour policy `π_behav` (the rollout's
`rollout_logprobs`) with the weight `π_prox / π_behav`
(`peerflow.algorithms.off_policy`). When `train_step` makes one optimiser step over the
batch (`trainer.mini_batches: 1`; there is no epochs setting), every micro-batch's
training forward runs on exactly those weights, so its log-probs, detached, *are*
`π_prox` — whatever the staleness of the samples (async mode, `weight_sync.every > 1`):
staleness separates `π_behav` from `π_prox`, never `π_prox` from the weights being
trained. The built-in GRPO graph then leaves out the `old_logprob` forward and the loss
takes the detached current log-probs as `π_prox`, importance weights and mismatch
metrics included (`peerflow.algorithms.off_policy.CurrentProximal`). With several
mini-batches every one after the first starts from updated weights, so `π_prox` must be
recomputed first. A custom graph (`workflow.nodes`) gets exactly the nodes it lists.
"""

from __future__ import annotations

from typing import Any

import attrs

from peerflow.workflow.graph import WorkflowGraph

#: Built-in graphs whose `old_logprob` node the fast path may drop.
FAST_PATH_GRAPHS: tuple[str, ...] = ("grpo",)

#: Why the built-in graph drops the node, in words (`peerflow plan`).
DROPPED_REASON = "1 optimiser step per batch, so the training forward gives π_prox"


def recompute_reasons(config: Any) -> list[str]:
    """Why `config`'s update needs `π_prox` recomputed before training (empty: it does not)."""
    reasons = []
    if config.trainer.mini_batches != 1:
        reasons.append(f"trainer.mini_batches={config.trainer.mini_batches} (every "
                       "mini-batch after the first starts from updated weights)")
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
        return OldLogprobDecision(kept=False, reason=DROPPED_REASON)
    reasons = recompute_reasons(config)
    if name not in FAST_PATH_GRAPHS:
        reasons.append(f"workflow.graph={name} always recomputes it")
    return OldLogprobDecision(kept=True, reason="; ".join(reasons))
