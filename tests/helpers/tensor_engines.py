"""Engines that serve and receive plain tensors: the two halves of the weight-sync contract."""

from __future__ import annotations

import contextlib

import torch

from peerflow.engines import EngineContext, RolloutEngine, TrainEngine
from peerflow.layout import ParallelLayout


class TensorTrainer(TrainEngine):
    """Serves fixed tensors as a trainer's weights (the weight-export half of the contract)."""

    name = "test-tensor-trainer"

    def __init__(self, specs, tensors):
        super().__init__(EngineContext(model_path="", layout=ParallelLayout()), None, None)
        self.specs, self.tensors, self.materialized = list(specs), tensors, []

    def forward_logprobs(self, batch):
        raise NotImplementedError("weight-export test engine")

    def train_step(self, batch, loss):
        raise NotImplementedError("weight-export test engine")

    def weight_sources(self):
        return self.specs

    def materialize(self, specs):
        self.materialized.append([s.local_name for s in specs])
        return contextlib.nullcontext([self.tensors[s.local_name] for s in specs])


class TensorRollout(RolloutEngine):
    """Keeps loaded tensors in a dict (the weight-import half of the contract)."""

    name = "test-tensor-rollout"

    def __init__(self, specs):
        super().__init__(EngineContext(model_path="", layout=ParallelLayout()), None)
        self.specs = list(specs)
        self.params = {s.local_name: torch.zeros(s.local_shape, dtype=getattr(torch, s.dtype))
                       for s in specs}
        self.calls = []

    def generate(self, requests, sampling):
        raise NotImplementedError("weight-import test engine")

    def weight_targets(self):
        return self.specs

    def load_weights(self, items):
        self.calls.append(len(items))
        for spec, tensor in items:
            assert tuple(tensor.shape) == spec.local_shape
            self.params[spec.local_name].copy_(tensor)
