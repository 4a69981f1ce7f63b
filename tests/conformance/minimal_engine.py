"""A minimal in-place-loading rollout adapter: the example of the authors' guide.

A transformers model sampled one token at a time (no KV cache), full HF tensors per rank,
weights copied in place. `peerflow conformance minimal` passes layers 0–3 with it.
"""

from __future__ import annotations

import torch

from peerflow import Capabilities, GenerationResult, RolloutEngine, ShardSpec, hf_layout
from peerflow.errors import ConfigError
from peerflow.plugins import hookimpl


class MinimalRollout(RolloutEngine):
    """Full HF model per rank; log-probs are log_softmax(logits / T) of each sampled token."""

    name = "minimal"
    capabilities = Capabilities(logprobs=True, in_place_weight_update=True)

    def __init__(self, context, options=None):
        super().__init__(context, options)
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            context.model_path, dtype=getattr(torch, context.dtype)).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])

    def generate(self, requests, sampling):
        if sampling.top_p < 1 or sampling.top_k > 0:
            raise ConfigError("the minimal engine samples without top-p/top-k; set them off")
        generator = torch.Generator().manual_seed(sampling.seed or 0)
        temperature = sampling.temperature or 1.0
        results = []
        for request in requests:
            for index in range(sampling.n):
                ids, logprobs, reason = list(request.prompt_ids), [], "length"
                for _ in range(sampling.max_tokens):
                    with torch.no_grad():
                        logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                    logp = torch.log_softmax(logits / temperature, dim=-1)
                    token = int(logits.argmax()) if sampling.temperature == 0 else \
                        int(torch.multinomial(logp.exp(), 1, generator=generator))
                    ids.append(token)
                    logprobs.append(float(logp[token]))
                    if token in self.eos or token in sampling.stop_token_ids:
                        reason = "stop"
                        break
                results.append(GenerationResult(
                    request_id=request.request_id, index=index, finish_reason=reason,
                    token_ids=ids[len(request.prompt_ids):], logprobs=logprobs,
                    version_segments=((0, self.weight_version),)))
        return results

    def weight_targets(self) -> list[ShardSpec]:
        return self.shard_layout(self.model.config, self.context.layout, self.context.rank)

    def load_weights(self, items):
        with torch.no_grad():
            for spec, tensor in items:
                self.model.get_parameter(spec.local_name).copy_(tensor)

    @classmethod
    def shard_layout(cls, hf_config, layout, rank, dtype="float32"):
        return hf_layout(hf_config, replica=layout.coord(rank).dp, dtype=dtype)

    @classmethod
    def conformance_families(cls):
        return ("llama", "qwen2", "qwen3")

    @classmethod
    def conformance_read_weights(cls, engine):
        return dict(engine.model.named_parameters())


@hookimpl
def peerflow_register_rollout_engines(register):
    register(MinimalRollout)
