"""The example `ddp` train engine with one planted mistake each: the train layer must name it.

The six mistakes a third-party author made (issue 51), one edit each, on the engine of
`contrib/example-plugin` (the correct control, `DDPTrainEngine`, passes every layer).
`EXPECTED_TRAIN` lists, per mutant, the test that must fail and what its message must
say: the cause and the author's method.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "contrib" / "example-plugin"))

from peerflow_example_plugin.trainer import DDPTrainEngine  # noqa: E402

from peerflow import ShardSpec  # noqa: E402
from peerflow.engines import tensors_of  # noqa: E402


class UnscaledLoss(DDPTrainEngine):
    """Backward of the loss as it is: DDP's averaging halves every gradient at dp = 2."""

    def backward_micro(self, loss, micro):
        loss.backward()


class TemperedTwice(DDPTrainEngine):
    """Divides the logits by the temperature itself; the toolkit divides them again."""

    def forward_micro(self, micro):
        return super().forward_micro(micro) / self.temperature


class WrapperNames(DDPTrainEngine):
    """Exports the DDP wrapper's parameters: `module.`-prefixed names at dp > 1."""

    def weight_sources(self):
        replica = self.context.layout.coord(self.context.rank).dp
        return [ShardSpec.of_slice(n, tuple(p.shape), replica=replica)
                for n, p in self.model.named_parameters()]

    @contextlib.contextmanager
    def materialize(self, specs):
        yield [t.detach() for t in tensors_of(specs, dict(self.model.named_parameters()),
                                               self.name)]


class ModelOnHost(DDPTrainEngine):
    """Leaves the model on the host (no `.to(device)`): caught on the emulated device."""

    def __init__(self, context, options=None, optim=None):
        super().__init__(context, options, optim)
        self.module.to("cpu")


class NoGradientSync(DDPTrainEngine):
    """No DDP wrapper at dp = 2: each replica steps on its own gradients and they diverge."""

    def __init__(self, context, options=None, optim=None):
        super().__init__(context, options, optim)
        self.model = self.module


class SharedRowsWithoutMask(DDPTrainEngine):
    """Shares prompts but forwards the rows without their 4-D mask."""

    def forward_micro(self, micro):
        inputs = micro.inputs
        return self.model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                          use_cache=False, logits_to_keep=inputs.logits_to_keep).logits


#: mutant → (the test that must fail, what its message must contain).
EXPECTED_TRAIN = {
    "UnscaledLoss": ("test_l3_train_step_dp2_matches_reference",
                     ["1/2 of the reference's", "UnscaledLoss.backward_micro",
                      "multiply the loss by the dp size"]),
    "TemperedTwice": ("test_l3_logprobs_match_reference",
                      ["tempered twice", "TemperedTwice.forward_micro",
                       "must return the raw logits"]),
    "WrapperNames": ("test_l3_train_step_dp2_matches_reference",
                     ["prefix 'module.'", "WrapperNames.weight_sources"]),
    "ModelOnHost": ("test_l3_weights_live_on_the_context_device", ["on cpu"]),
    "NoGradientSync": ("test_l3_train_step_dp2_matches_reference",
                       ["replicas diverge", "gradients are not synchronised"]),
    "SharedRowsWithoutMask": ("test_l3_train_shared_prompts_match_unshared",
                              ["attention_mask_as", "SharedRowsWithoutMask.forward_micro"]),
}
