"""Rollout's shared pieces: the prompts a rank draws, their rendering, answers to a `Batch`.

Below both drivers that use them: the worker's single-turn `generate` node and the
multi-turn episodes of `peerflow.agents` (and `peerflow sft`, the checks before launch).
Modules: `sampler` (the deterministic per-dp-rank prompt sampler, `Draw`), `prompts` (a
model directory's tokenizer, chat templates, prompt encoding), `generate` (one generate
call into a ragged batch, the `RolloutEngine.generate` contract check, seeds).
"""
