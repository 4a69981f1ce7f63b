"""`sglang`: the SGLang rollout engine (GPU only; not installable on CPU machines).

Implemented against SGLang's offline `sglang.Engine` API, imported lazily:

* generation: `Engine.generate(input_ids=…, sampling_params=[…], return_logprob=True)`;
  each of the n samples of a prompt is its own request (the radix cache shares the
  prompt), so results come back in a known order with per-sample seeds;
* weights: `Engine.update_weights_from_tensor(named_tensors, load_format="direct",
  flush_cache=False)` copies tensors in SGLang's own layout (fused `qkv_proj` /
  `gate_up_proj`, padded vocabulary, tp slices; `peerflow.models.vllm.sglang_layout`)
  straight into the parameters of the matching name; with tp > 1 each tensor is a
  per-rank `LocalSerializedTensor`, so every scheduler process receives only its shard;
  `Engine.flush_cache()` after the sync. The broadcast path SGLang also offers
  (`init_weights_update_group` + `update_weights_from_distributed`, HF tensors over NCCL)
  is exposed as `join_weight_group` / `load_weights_from_group` for transports that
  broadcast full tensors;
* memory: `release_memory_occupation()` / `resume_memory_occupation()` (`sleep`/`wake`).

Status: written from SGLang's source; SGLang cannot be installed on PeerFlow's CPU CI
machines, so this adapter has not run there (see docs/gpu-validation.md for GPU runs).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from peerflow.adapters.sglang.options import SGLangRolloutOptions
from peerflow.capabilities import Capabilities
from peerflow.engines import (
    EngineContext,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from peerflow.engines.tp_rollout import TensorParallelRolloutEngine
from peerflow.models.common import RankCoords
from peerflow.models.vllm import sglang_layout
from peerflow.shard import ShardSpec


def _local_serialized_tensor_class() -> Any:
    # The class moved from model_runner to weight_updater in newer SGLang releases.
    try:
        from sglang.srt.model_executor.weight_updater import LocalSerializedTensor
    except ImportError:
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor
    return LocalSerializedTensor


class SGLangRolloutEngine(TensorParallelRolloutEngine):
    """Rollout engine on SGLang's offline `Engine` (GPU machines with SGLang installed).

    Options: `SGLangRolloutOptions` (`rollout.sglang: {...}`).
    """

    name: ClassVar[str] = "sglang"
    capabilities: ClassVar[Capabilities] = attrs.evolve(
        TensorParallelRolloutEngine.capabilities, sleep=True, gpu_only=True,
        reasons={"routed_experts": "SGLang's return_routed_experts is not wired: SGLang "
                                   "cannot be installed or exercised on these CPU machines",
                 "lora": "SGLang cannot be installed or exercised on these CPU machines, so "
                         "its LoRA API is not wired yet"})
    options_class: ClassVar[type] = SGLangRolloutOptions
    options: SGLangRolloutOptions
    requires: ClassVar[tuple[str, ...]] = ("sglang",)
    install_hint: ClassVar[str] = (
        "pip install 'peerflow[sglang]' on a machine with a CUDA GPU (SGLang has no CPU "
        "build on PyPI)"
    )

    def __init__(self, context: EngineContext, options: SGLangRolloutOptions | None = None
                 ) -> None:
        super().__init__(context, options)
        self.engine = self._start()
        tokenizer = self.engine.tokenizer_manager.tokenizer
        self._declare_targets(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    @property
    def tp_size(self) -> int:
        """SGLang's `tp_size`."""
        return self.options.tp_size

    def _start(self) -> Any:
        import sglang

        opts = self.options
        kwargs: dict[str, Any] = dict(
            model_path=self.context.model_path,
            dtype=self.context.dtype,
            random_seed=self.context.seed,
            tp_size=opts.tp_size,
            mem_fraction_static=opts.mem_fraction_static,
            enable_memory_saver=opts.enable_memory_saver,
            disable_radix_cache=opts.disable_radix_cache,
        )
        if opts.max_running_requests is not None:
            kwargs["max_running_requests"] = opts.max_running_requests
        if opts.context_length is not None:
            kwargs["context_length"] = opts.context_length
        kwargs.update(opts.engine_args)
        return sglang.Engine(**kwargs)

    # -- generation ---------------------------------------------------------------------

    def _sampling_dict(self, sampling: SamplingParams, seed: int | None) -> dict[str, Any]:
        params: dict[str, Any] = dict(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_new_tokens=sampling.max_tokens,
            no_stop_trim=self.options.include_stop_str_in_output,
        )
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if seed is not None:
            params["sampling_seed"] = seed
        return params

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Samples `sampling.n` answers per request in one `Engine.generate` call.

        With `sampling.seed` set, sample `k` of request `i` uses seed
        `seed + i * n + k` (SGLang's `sampling_seed`).
        """
        if not requests:
            return []
        n = sampling.n
        input_ids, params = [], []
        for i, request in enumerate(requests):
            for k in range(n):
                input_ids.append(list(request.prompt_ids))
                seed = None if sampling.seed is None else sampling.seed + i * n + k
                params.append(self._sampling_dict(sampling, seed))
        outputs = self.engine.generate(input_ids=input_ids, sampling_params=params,
                                       return_logprob=sampling.logprobs)
        results = []
        for j, output in enumerate(outputs):
            request = requests[j // n]
            meta = output["meta_info"]
            tokens = list(output["output_ids"])
            logprobs = ([float(entry[0]) for entry in meta["output_token_logprobs"]]
                        if sampling.logprobs else [])
            finish = meta.get("finish_reason") or {}
            reason = finish.get("type", "length") if isinstance(finish, dict) else str(finish)
            stopped = isinstance(finish, dict) and isinstance(finish.get("matched"), str)
            results.append(self._answer(request, j % n, tokens, logprobs, reason=reason,
                                        stop_text=output.get("text", "") if stopped else None))
        return results

    # -- weights ------------------------------------------------------------------------

    def load_weights(self, items: Sequence[tuple[ShardSpec, torch.Tensor]]) -> None:
        """Copies one bucket of SGLang-layout tensors into the live parameters.

        Raises:
            ValueError: a spec is not one of `weight_targets()` or a tensor's shape or
                dtype differs from its spec.
        """
        start = time.perf_counter()
        per_name: dict[str, dict[int, torch.Tensor]] = {}
        sync: Counter[str] = Counter(buckets=1)
        for spec, tensor in items:
            tp_rank, name = self._check_item(spec, tensor)
            per_name.setdefault(name, {})[tp_rank] = tensor.detach().contiguous()
            sync["bytes"] += tensor.numel() * tensor.element_size()
        named = self._named_tensors(per_name)
        sync["pack_s"] += time.perf_counter() - start
        start = time.perf_counter()
        result = self.engine.update_weights_from_tensor(named, load_format="direct",
                                                        flush_cache=False)
        _raise_on_failure(result, "update_weights_from_tensor")
        sync["wire_s"] += time.perf_counter() - start
        self._sync.update(sync)

    def _named_tensors(self, per_name: dict[str, dict[int, torch.Tensor]]) -> list:
        tp = self.options.tp_size
        if tp == 1:
            return [(name, shards[0]) for name, shards in per_name.items()]
        from sglang.srt.utils import MultiprocessingSerializer

        local_tensor = _local_serialized_tensor_class()
        named = []
        for name, shards in per_name.items():
            if len(shards) != tp:
                raise ValueError(
                    f"SGLangRolloutEngine.load_weights: bucket holds {sorted(shards)} of the "
                    f"{tp} tp shards of {name!r}; SGLang loads every rank's shard of a "
                    "parameter in one call, so keep them in one bucket."
                )
            values = [MultiprocessingSerializer.serialize(shards[r]) for r in range(tp)]
            named.append((name, local_tensor(values=values)))
        return named

    def finish_weight_update(self) -> None:
        """Flushes SGLang's radix cache and publishes the new version."""
        self.engine.flush_cache()
        super().finish_weight_update()

    def join_weight_group(self, master_address: str, master_port: int, rank_offset: int,
                          world_size: int, group_name: str = "peerflow",
                          backend: str = "nccl") -> None:
        """Joins a trainer-created process group for broadcast syncs.

        SGLang's `init_weights_update_group`: the trainer is rank 0, SGLang's tp ranks
        start at `rank_offset`.
        """
        result = self.engine.init_weights_update_group(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend,
        )
        _raise_on_failure(result, "init_weights_update_group")

    def load_weights_from_group(self, names: Sequence[str], dtypes: Sequence[str],
                                shapes: Sequence[Sequence[int]],
                                group_name: str = "peerflow") -> None:
        """Receives full HF tensors the trainer broadcasts, in this order.

        SGLang's `update_weights_from_distributed`; SGLang fuses and slices them itself.
        """
        result = self.engine.update_weights_from_distributed(
            names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes],
            group_name=group_name, flush_cache=False,
        )
        _raise_on_failure(result, "update_weights_from_distributed")

    def read_parameter(self, name: str, numel: int) -> torch.Tensor:
        """Returns the first `numel` values of SGLang parameter `name`.

        Read inside SGLang's scheduler (`get_weights_by_name`), bypassing PeerFlow's
        loading path.
        """
        values = self.engine.get_weights_by_name(name, truncate_size=numel)
        return torch.tensor(values)

    # -- conformance hooks (read by peerflow.conformance; see its profile module) ---------

    @classmethod
    def shard_layout(cls, hf_config: Any, layout: Any, rank: int) -> list[ShardSpec]:
        """Returns what one SGLang tp rank of `layout` holds (no engine built).

        SGLang's tp scheduler processes are driven by the engine on one host rank, whose
        `weight_targets()` lists every rank's shards prefixed `tp{r}/`; tp rank r's part
        is exactly this function's result for rank r.
        """
        return sglang_layout(hf_config, RankCoords.of(layout, rank))

    @classmethod
    def conformance_read_weights(cls, engine: SGLangRolloutEngine) -> dict[str, torch.Tensor]:
        """Reads every parameter inside SGLang's scheduler (`get_weights_by_name`).

        Needs tp 1 (SGLang returns the tp-rank-0 shard only).
        """
        if engine.options.tp_size != 1:
            raise NotImplementedError("conformance_read_weights reads tp_size 1 engines only")
        out = {}
        for spec in engine.weight_targets():
            flat = engine.read_parameter(spec.local_name, spec.numel)
            out[spec.local_name] = flat.to(getattr(torch, spec.dtype)).reshape(spec.local_shape)
        return out

    # -- lifecycle ----------------------------------------------------------------------

    def sleep(self) -> None:
        """Frees weights and KV cache (`release_memory_occupation`)."""
        self.engine.release_memory_occupation()

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Restores weights and/or KV cache (`resume_memory_occupation(tags)`)."""
        self.engine.resume_memory_occupation(tags=list(tags) if tags else None)

    def shutdown(self) -> None:
        """Stops SGLang's processes. Safe to call twice."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None


def _raise_on_failure(result: Any, call: str) -> None:
    """SGLang answers weight calls with `(success, message)`; turn a failure into an error."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"SGLang {call} failed: {result[1] if len(result) > 1 else result}")
    if isinstance(result, dict) and result.get("success") is False:
        raise RuntimeError(f"SGLang {call} failed: {result.get('message')}")
