"""Streaming assignment of finished groups to trainer dp-ranks by running token counts.

Each rollout rank decides alone where its finished groups go (no metadata exchange on the
data path): a group goes to the trainer dp-rank that has received the fewest tokens *from
this rollout rank* in the group's step, ties broken in an order rotated by the rollout
rank so that several rollout ranks do not all favour trainer 0. Within one step and one
source, trainers stay within one group's tokens of each other, so across `R` sources the
spread is at most `R` groups' tokens.

A group weighs what it costs its trainer (`coordinator.units.Balance.loads`): every
answer, and its prompt once per answer, or once for the group when the trainers run a
prompt once for all its answers (`CausalLMTrainEngine.shares_prompts`).
"""

from __future__ import annotations

import attrs

from peerflow.batch import Batch
from peerflow.checkpoint.state import JsonState
from peerflow.coordinator.units import Balance
from peerflow.errors import ConfigError


@attrs.define(eq=False)
class TokenBalancer(JsonState):
    """Chooses the trainer dp-rank of each finished group (run on one rollout rank)."""

    num_consumers: int
    """Trainer dp-ranks."""
    source_index: int = 0
    """This rollout rank's dp index (rotates tie-breaking)."""
    tokens: dict[int, list[int]] = attrs.field(factory=dict)
    """Step → tokens sent to each consumer in that step."""
    groups: dict[int, list[int]] = attrs.field(factory=dict)
    """Step → groups sent to each consumer in that step."""
    shared_prompts: bool = False
    """The trainers run a prompt once for all its answers (their `shares_prompts`)."""

    def __attrs_post_init__(self) -> None:
        if self.num_consumers < 1:
            raise ConfigError(
                f"TokenBalancer.num_consumers={self.num_consumers}: the trainer role needs "
                "at least one dp-rank; check trainer.layout."
            )

    def assign(self, step: int, tokens: int) -> int:
        """Returns the consumer dp-rank for a group of `tokens` tokens in `step`.

        A consumer that has no group yet in the step is preferred, so every trainer gets
        work whenever the step has at least as many groups as trainers.
        """
        counts = self.tokens.setdefault(step, [0] * self.num_consumers)
        groups = self.groups.setdefault(step, [0] * self.num_consumers)
        order = [(self.source_index + i) % self.num_consumers for i in range(self.num_consumers)]
        best = min(order, key=lambda c: (groups[c] > 0, counts[c], order.index(c)))
        counts[best] += int(tokens)
        groups[best] += 1
        return best

    def assign_group(self, step: int, group: Batch) -> int:
        """Returns the consumer dp-rank for the finished prompt group `group` in `step`."""
        load = Balance(shared_prompts=self.shared_prompts).loads(group)
        return self.assign(step, int(load.sum()))

    def forget_before(self, step: int) -> None:
        """Drops the counts of steps before `step` (they are sealed)."""
        for old in [s for s in self.tokens if s < step]:
            del self.tokens[old]
            self.groups.pop(old, None)
