"""The `hf` engine with one planted LoRA fault each: the suite's LoRA layer must catch them.

Each fault is in where a synced adapter tensor lands or how it is applied; `EXPECTED_LORA`
lists what the failure must say (the tensor, and what to check).
"""

from __future__ import annotations

from peerflow.adapters.hf.engine import HFRolloutEngine


def _swap(name: str, a: str, b: str) -> str:
    return name.replace(a, "\0").replace(b, a).replace("\0", b)


class LoraWrongScaling(HFRolloutEngine):
    """Applies `B @ A` unscaled (scaling 1 instead of alpha / rank)."""

    def __init__(self, context, options=None):
        super().__init__(context, options)
        for module in self.model.modules():
            if isinstance(getattr(module, "scaling", None), dict):
                module.scaling = {key: 1.0 for key in module.scaling}


class LoraSwappedAB(HFRolloutEngine):
    """Loads `A` into `B` and `B` into `A` (transposed) where the shapes allow it."""

    def _param(self, spec):
        name = spec.local_name
        if ".q_proj." in name or ".o_proj." in name:  # square: A.T fits B
            return self._params[_swap(name, ".lora_A.", ".lora_B.")].T
        return super()._param(spec)


class LoraWrongModule(HFRolloutEngine):
    """Loads the k_proj adapter into v_proj and the v_proj one into k_proj."""

    def _param(self, spec):
        return self._params[_swap(spec.local_name, ".k_proj.", ".v_proj.")]


#: mutant → strings its LoRA-layer failure must contain.
EXPECTED_LORA = {
    "LoraWrongScaling": ["applies scaling 1 instead of alpha / rank = 3",
                         "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"],
    "LoraSwappedAB": ["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight",
                      "which of A ([rank, in]) and B ([out, rank])"],
    "LoraWrongModule": ["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight",
                        "check which module"],
}
