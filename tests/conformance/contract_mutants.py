"""The `hf` engine with one planted generate-contract or replica fault each.

The suite must fail each naming the check: `EXPECTED_CONTRACT` lists the test that must
fail and what its message must say. `HFWithLayout` (from `mutants.py`) is the correct
control and passes the same layers.
"""

from __future__ import annotations

import attrs
import torch
from mutants import HFWithLayout  # noqa: I001  (tests/conformance is on sys.path)

from peerflow.layout import ParallelLayout


class IgnoresStopStrings(HFWithLayout):
    """Declares `Capabilities.stop_strings` (as `hf` does) but never looks at them."""

    def generate(self, requests, sampling):
        return super().generate(requests, attrs.evolve(sampling, stop=()))


class WrongFinishReason(HFWithLayout):
    """Reports `stop` for every sample, also those cut off at `max_tokens`."""

    def generate(self, requests, sampling):
        return [attrs.evolve(r, finish_reason="stop")
                for r in super().generate(requests, sampling)]


class ReseedsGlobalRNG(HFWithLayout):
    """Reseeds torch's global RNG on every call (transformers' continuous batching does)."""

    def generate(self, requests, sampling):
        torch.manual_seed(0 if sampling.seed is None else sampling.seed)
        return super().generate(requests, sampling)


class UnmarkedReplicas(HFWithLayout):
    """A full model per dp rank, every copy declared as replica 0: `HFWithLayout`'s
    `shard_layout` gives `hf_layout` no rank coordinates (no `replica=`), run on dp=2."""

    @classmethod
    def conformance_layouts(cls):
        return [ParallelLayout(), ParallelLayout(dp=2)]


#: mutant → (the test that must fail, its layer, strings its message must contain).
EXPECTED_CONTRACT = {
    "IgnoresStopStrings": ("test_l3_generate_honours_stop_strings", 3, [
        "IgnoresStopStrings.generate returned", "declares Capabilities.stop_strings",
        "end a sample at the first stop string"]),
    "WrongFinishReason": ("test_l3_generate_finish_reason", 3, [
        "WrongFinishReason.generate finish_reason", "report 'length'"]),
    "ReseedsGlobalRNG": ("test_l3_generate_leaves_torch_rng_alone", 3, [
        "ReseedsGlobalRNG.generate changed torch's global RNG state",
        "torch.random.fork_rng"]),
    "UnmarkedReplicas": ("test_l1_copies_are_marked_as_replicas", 1, [
        "ranks 0 and 1 both hold it as replica 0",
        "UnmarkedReplicas.shard_layout must give every other copy `replica > 0`",
        "RankCoords.of(layout, rank)"]),
}
