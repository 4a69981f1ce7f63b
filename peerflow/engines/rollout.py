"""The rollout (inference) engine contract.

Designed against vLLM (`LLM.generate` with `SamplingParams(n=…, logprobs=…)`, worker
extensions + `collective_rpc` for in-place weight loading, `reset_prefix_cache`,
`sleep`/`wake_up`), SGLang (`Engine.generate(input_ids=…, return_logprob=True)`,
`update_weights_from_tensor`, `update_weights_from_distributed`, `flush_cache`,
`release_memory_occupation`/`resume_memory_occupation`) and Hugging Face `generate`.

The same contract, with the randomness rules and a worked example, is written out for
authors in docs/conformance.md ("The rollout engine contract") and CONTRIBUTING.md
("Writing an engine adapter").

Call order on the ranks that host the engine (all ranks of its group, SPMD — every tp/pp
peer of one dp replica makes the same calls with the same arguments, like vLLM's
`external_launcher` executor; an engine that drives its own tp workers is hosted on one
rank per replica and declares `Capabilities.multiprocess`, usually by subclassing
`peerflow.engines.TensorParallelRolloutEngine`):

1. `__init__(context, options=None)` — build the engine, load `context.model_path` in
   `context.dtype` on `context.device`. The runtime always passes `options`, an instance
   of the class's `options_class` built from the config's `rollout.<name>` section
   (`NoOptions()` when the engine has none); `None` (direct callers) means
   `options_class()`. Call `super().__init__(context, options)` first: it stores both
   and sets `weight_version` to 0.
2. `weight_targets()` — once; the weight-sync service (`peerflow.reshard.service`) plans
   every sync against these specs.
3. Repeatedly, in any order:
   * `generate(requests, sampling)` — the rollout driver (`peerflow.rollout`), once per
     batch or chunk of prompts;
   * a weight sync, driven by the weight-sync service on every rank of the group:
     `begin_weight_update(version)`, then per bucket `weight_buffers(specs)` (optional
     zero-copy path) and `load_weights(items)`, then `finish_weight_update()` (resets
     caches and publishes `version`);
   * with `Capabilities.sleep`, when the engine is colocated with a trainer
     (`peerflow.reshard.time_share`, in the order of verl's hybrid engine): `sleep()` after
     generating; before the next generation `wake(("weights",))`, a weight sync,
     `wake(("kv_cache",))`.
4. `shutdown()` — by the worker when the run ends or fails.

Override rules: `__init__`, `begin_weight_update` and `finish_weight_update` must call
`super()`: the base class records the pending version in `begin_weight_update` and
publishes it in `finish_weight_update` (without them samples keep the old
`weight_version`, or the sync fails on the missing pending version). Every other
method is yours. Optional methods have defaults that are never called unless the matching
capability is declared: `sleep`/`wake` (`Capabilities.sleep`), `pause`/`resume`
(`Capabilities.partial_rollout`; the runtime does not call them yet: `runtime.partial_rollout`
chunks `generate` calls on every engine, `peerflow.streaming.partial`), `weight_buffers`
(always called; `None` means "stage a copy"). The conformance suite additionally looks up
classmethods of the engine class (`shard_layout`, `conformance_*`); see
`peerflow/conformance/README.md`.

Refusing what the engine cannot do, before any process starts: leave the capability
`False` in `capabilities` and say why in `Capabilities.reasons` (`peerflow config
validate` refuses the settings that need it); for a setting no capability covers (e.g.
`rollout.sampling.top_p < 1` on an engine without truncation) implement the
`peerflow_validate_config` hook in the plugin and return the problem. `generate` still
raises `peerflow.errors.ConfigError` naming the setting and the fix when it gets such a
request (benchmarks, tests), and never samples another distribution instead.

Log-probs (`GenerationResult.logprobs`), the one contract every engine and the trainer
share: for each generated token t, `log_softmax(logits / T)[t]`, where `logits` are the
model's next-token logits and T is `SamplingParams.temperature` — the tempered
distribution **before** top-k/top-p truncation, not renormalised over the kept tokens.
Train engines compute exactly this (`log_softmax(logits / T)` at the response tokens), so
the PPO ratio of a fresh sample is 1 up to float noise. Greedy decoding (T = 0) reports
`log_softmax(logits)` (T taken as 1). An engine that cannot return this quantity for some
setting (e.g. vLLM renormalises after top-p) raises `ConfigError` for that setting rather
than return another one. The conformance suite checks it by sampling at T = 1 and T = 0.7.

EOS and padding: a sample ends at an end-of-sequence id — every id in the checkpoint's
`generation_config.json` `eos_token_id`, the model config's `eos_token_id` and the
tokenizer's `eos_token_id` (lists allowed) — or at one of `SamplingParams.stop_token_ids`;
the EOS token is kept in `token_ids`. Padding is internal to an engine (results are never
padded); engines that need a pad id take the tokenizer's `pad_token_id`, else the smallest
EOS id. Nothing in PeerFlow's runtime depends on either id: prompts arrive as token ids.

Sampling settings: `SamplingParams` define sampling completely. The sampling defaults of
the checkpoint's `generation_config.json` (`top_k`, `top_p`, `temperature`,
`repetition_penalty`, …) are ignored; only its `eos_token_id` is read.

Randomness: torch's global RNG (and CUDA's) belongs to a colocated trainer; `generate`
never draws from it nor reseeds it. With `SamplingParams.seed` the answers of a call
depend only on the requests, the sampling settings and the weights; without it they come
from a stream of the engine's own, seeded from `EngineContext.seed` and the rank's dp
replica (`RankCoords.of(context.layout, context.rank).dp_rank`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import attrs
import torch

from peerflow.engines.base import EngineBase, EngineContext
from peerflow.shard import ShardSpec


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample; the subset every engine supports, with vLLM's meanings."""

    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature T: tokens are drawn from softmax(logits / T) (then top-k/top-p);
    0 means greedy. Log-probs are `log_softmax(logits / T)` (see the module docstring)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 disables)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 disables)."""
    max_tokens: int = 64
    """Most tokens to generate per sample."""
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Stop strings; a sample ends at the first one, which is removed from the output
    (vLLM's default)."""
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    """Extra token ids that end a sample (EOS always does)."""
    seed: int | None = None
    """Seed of the whole call: the same requests, settings, weights and seed give the same
    answers (the n samples of a request, and equal prompts, still differ). The runtime
    passes one per generate call (from the run seed, step, dp rank and attempt); `None`
    draws from the engine's own stream. Never torch's global RNG either way."""
    logprobs: bool = True
    """Return the log-probability of each sampled token."""


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One prompt to sample `SamplingParams.n` answers for."""

    request_id: int
    """Caller's id, echoed in results (PeerFlow uses the prompt's `group_id`)."""
    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    """Prompt token ids (already chat-templated)."""


@attrs.frozen(kw_only=True)
class GenerationResult:
    """One sampled answer."""

    request_id: int
    """The `GenerationRequest.request_id` it answers."""
    index: int
    """Which of the n samples (0 … n-1)."""
    token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    """Generated token ids (stop string removed, EOS kept when it ended the sample)."""
    logprobs: tuple[float, ...] = attrs.field(default=(), converter=tuple)
    """`log_softmax(logits / T)` of each generated token, T the sampling temperature, before
    top-k/top-p truncation (T = 0: `log_softmax(logits)`); one per token of `token_ids`,
    empty when `SamplingParams.logprobs` is False. See the module docstring."""
    finish_reason: str = "length"
    """`stop` (EOS, stop token or stop string), `length` (hit `max_tokens`) or `abort`."""
    version_segments: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=tuple)
    """`(first_token_index, weight_version)` for each run of tokens produced by one policy
    version; one entry unless weights changed mid-request (partial rollout)."""
    routed_experts: torch.Tensor | None = attrs.field(default=None, eq=False)
    """Mixture-of-experts models, engines with `Capabilities.routed_experts`: the experts
    each prompt and answer token was routed to, int16 `[len(prompt) + len(token_ids),
    layers, top_k]`, logical expert ids, -1 where there is no route (layers without a
    router, the last sampled token, tokens the engine did not route). `None` otherwise."""


class RolloutEngine(EngineBase, abc.ABC):
    """An inference engine that samples answers and accepts new weights in place.

    The contract (call order, override rules, log-probs, EOS, randomness, refusals) is in
    this module's docstring and, for plugin authors, in docs/conformance.md ("The rollout
    engine contract"); CONTRIBUTING.md walks through a complete engine.

    Args:
        context: Where and what to load, one per rank (`EngineContext`).
        options: An instance of `options_class`; the runtime always passes one, built
            from the config's `rollout.<name>` section. `None` means `options_class()`.
    """

    def __init__(self, context: EngineContext, options: object | None = None) -> None:
        self.context = context
        self.options = options if options is not None else self.options_class()
        self.capabilities = type(self).machine_capabilities()  # what this machine allows
        self._weight_version = 0

    @property
    def weight_version(self) -> int:
        """Version of the weights now loaded (0 for the initial checkpoint)."""
        return self._weight_version

    @abc.abstractmethod
    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Samples `sampling.n` answers for every request.

        The whole contract — EOS ids, `finish_reason`, `SamplingParams.seed`, sampling from
        an RNG of the engine's own, ignoring the checkpoint's generation defaults — is
        written out in docs/conformance.md ("The rollout engine contract") and checked by
        `peerflow conformance NAME -k generate`.

        Args:
            requests: Prompts; every rank of one replica passes the same list.
            sampling: Sampling settings shared by all requests.

        Returns:
            `len(requests) * sampling.n` results, grouped by request in request order,
            each with `log_softmax(logits / sampling.temperature)` of every sampled token
            (before top-k/top-p; see the module docstring). Requests and results are host
            values (token ids and log-probs as Python numbers): the engine moves its inputs
            to its device and its outputs back itself.

        Raises:
            ConfigError: A setting the engine cannot honour (`top_p`/`top_k` without
                truncation, `stop` without `Capabilities.stop_strings`), naming it and
                the fix; never sample another distribution instead.
        """

    @abc.abstractmethod
    def weight_targets(self) -> list[ShardSpec]:
        """Returns the specs of every tensor this rank holds and wants filled by a sync."""

    def begin_weight_update(self, version: int) -> None:
        """Prepares to receive weights of `version` (called on every rank of the group).

        Called by the weight-sync service before the first bucket. An override (to pause
        a scheduler, clear per-sync timers) must call `super().begin_weight_update(version)`,
        which records the version `finish_weight_update` publishes.
        """
        self._pending_version = version

    @abc.abstractmethod
    def load_weights(self, items: Sequence[tuple[ShardSpec, torch.Tensor]]) -> None:
        """Copies one bucket of tensors into the engine.

        Copies: `items` are staging buffers the sync reuses for the next bucket, so an
        engine must copy their values into its own storage (`param.copy_(tensor)`), never
        keep or rebind to them (`param.data = tensor`).

        Args:
            items: `(spec, tensor)` pairs; every spec is one of `weight_targets()` and the
                tensor has `spec.local_shape` with every non-padding element filled.
        """

    def weight_buffers(self, specs: Sequence[ShardSpec]) -> list[torch.Tensor] | None:
        """Optional zero-copy fast path: the engine's own tensors for `specs`, or `None`.

        When an engine returns its live local tensors (same shapes as the specs), the
        weight sync writes received regions straight into them instead of staging a copy,
        then still calls `load_weights` with those very tensors (an engine skips copying a
        tensor onto itself, and may post-process, e.g. repack kernels). Called between
        `begin_weight_update` and `finish_weight_update`. The default, `None`, stages.
        """
        return None

    def finish_weight_update(self) -> None:
        """Publishes the pending version; engines reset prefix caches here.

        Called by the weight-sync service after the last bucket, on every rank of the group.
        An override must call `super().finish_weight_update()`, which is what advances
        `weight_version`; without it samples keep the old version.
        """
        self._weight_version = self._pending_version

    def _unsupported(self, capability: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} does not declare Capabilities.{capability}; the runtime "
            "must not call this method."
        )

    def sleep(self) -> None:
        """Releases accelerator memory: weights and KV cache (needs `Capabilities.sleep`).

        Called after generating by colocated placement (`peerflow.reshard.time_share`),
        so the trainer can use the memory.
        """
        raise self._unsupported("sleep")

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Restores what `sleep` released (needs `Capabilities.sleep`).

        Called by colocated placement before the next weight sync or generation, always
        with `tags`: `("weights",)`, then the sync loads new weights into them, then
        `("kv_cache",)`, so the two are never both allocated beside stale buffers. An
        engine that cannot restore the parts separately restores everything on the first
        call and treats the later one as a no-op.

        Args:
            tags: What to restore: `"weights"`, `"kv_cache"`, or both; `None` means both.
        """
        raise self._unsupported("sleep")

    def pause(self) -> None:
        """Stops generation between tokens so weights can change (`partial_rollout`).

        Reserved for engines that pause in-flight requests themselves; the runtime does not
        call it yet (see the module docstring).
        """
        raise self._unsupported("partial_rollout")

    def resume(self) -> None:
        """Continues paused requests under the new weights (`partial_rollout`).

        Reserved, like `pause`.
        """
        raise self._unsupported("partial_rollout")

    def shutdown(self) -> None:
        """Releases the engine's processes and memory. Safe to call twice.

        Called by the worker when the run ends or fails (also by benchmarks and tests).
        """


__all__ = [
    "EngineContext",
    "GenerationRequest",
    "GenerationResult",
    "RolloutEngine",
    "SamplingParams",
]


def tokens_before_stop(decode: Callable[[list[int]], str], tokens: list[int], text: str) -> int:
    """Returns how many tokens to keep so the answer ends before its stop string.

    Engines trim the stop string from the text but not always from the token ids;
    PeerFlow's contract trims both. Keeps the longest prefix whose decoded text fits in
    the engine's trimmed `text`.

    Args:
        decode: Token ids to text (special tokens skipped).
        tokens: The sampled token ids.
        text: The engine's text, already cut before the stop string.
    """
    for keep in range(len(tokens), -1, -1):
        if len(decode(tokens[:keep])) <= len(text):
            return keep
    return 0

