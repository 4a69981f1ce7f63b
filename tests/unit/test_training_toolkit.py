"""The training toolkit: micro-batch plans, tempered log-probs and entropy (full and
vocab-parallel), and `CausalLMTrainEngine` driving a real torch module."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from peerflow import ParallelLayout
from peerflow.batch import Batch, RaggedField
from peerflow.engines import EngineContext, OptimSettings
from peerflow.launch.warm import warm_context
from peerflow.training import (
    CausalLMTrainEngine,
    MicroBatch,
    VocabShard,
    fixed_shape_micro_batches,
    pack_by_tokens,
    plan_micro_batches,
    split_mini_batches,
    token_entropy,
    token_logprobs,
)
from peerflow.training.inputs import pad_inputs
from tests.helpers.gloo import free_port, start_warm, stop_warm

VOCAB = 11


def test_plans_cover_every_sample_once_within_the_budget():
    lengths = [5, 30, 12, 12, 7, 40, 3, 9]
    plan = plan_micro_batches(lengths, budget=40)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 40 or len(b) == 1 for b in plan)
    fixed, (rows, width) = fixed_shape_micro_batches(lengths, budget=90)
    assert (rows, width) == (2, 40) and [i for b in fixed for i in b] == list(range(8))
    assert fixed_shape_micro_batches([], 10) == ([[]], (10, 1))
    assert split_mini_batches(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_mini_batches(1, 3) == [[0], [], []]
    with pytest.raises(ValueError, match="mini_batches=0"):
        split_mini_batches(4, 0)
    with pytest.raises(ValueError, match="micro_batch_tokens=0"):
        plan_micro_batches([3], 0)


def _padded(plan: list[list[int]], lengths: list[int]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in plan if b)


def test_long_tails_are_cut_off_and_near_equal_lengths_stay_together():
    from peerflow.training.microbatch import OVERHEAD_DIVISOR, _cheapest_cuts

    answers = [600, 250, 180, 140]  # the realistic shape: geometric answers after 128 tokens
    lengths = [128 + a for a in answers]
    plan = pack_by_tokens(lengths, 8192)
    assert plan == [[0], [1], [2, 3]]  # 728 + 378 + 2 * 308 padded tokens, not 4 * 728
    assert _padded(plan, lengths) == 1722 < 4 * 728
    near = [9] * 200 + [8] * 40 + [7] * 16  # quickstart-like: one pass is cheapest
    assert [len(b) for b in pack_by_tokens(near, 8192)] == [256]

    def exact(longest_first: list[int], budget: int, overhead: int) -> int:
        cost = [0] * (len(longest_first) + 1)
        for i in range(len(longest_first) - 1, -1, -1):
            cap = min(len(longest_first), i + max(1, budget // longest_first[i]))
            cost[i] = min((j - i) * longest_first[i] + overhead + cost[j]
                          for j in range(i + 1, cap + 1))
        return cost[0]

    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        lengths = sorted(torch.randint(1, 40, (int(torch.randint(1, 30, ())),),
                                       generator=g).tolist(), reverse=True)
        budget = int(torch.randint(20, 300, ()))
        overhead = budget // OVERHEAD_DIVISOR
        cuts = _cheapest_cuts(lengths, budget, overhead)
        runs = list(zip(cuts, cuts[1:]))
        assert cuts[0] == 0 and cuts[-1] == len(lengths)
        assert all(j - i == 1 or (j - i) * lengths[i] <= budget for i, j in runs)
        cost = sum((j - i) * lengths[i] + overhead for i, j in runs)
        assert cost <= 1.02 * exact(lengths, budget, overhead)  # near the exact optimum


def test_pad_inputs_lays_out_prompt_then_response_right_padded():
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[1, 2], [], [3, 4, 2, 2]]  # ragged, one empty answer
    batch = Batch(sample_id=torch.arange(3), group_id=torch.arange(3),
                  weight_version=torch.zeros(3, dtype=torch.int64))
    batch.set("prompt_ids", RaggedField.from_lists(prompts, torch.int64))
    batch.set("response_ids", RaggedField.from_lists(responses, torch.int64))
    inputs = pad_inputs(batch)
    assert inputs.input_ids.tolist() == [[5, 6, 7, 1, 2, 0], [8, 0, 0, 0, 0, 0],
                                         [9, 10, 3, 4, 2, 2]]
    assert inputs.attention_mask.tolist() == [[1] * 5 + [0], [1] + [0] * 5, [1] * 6]
    assert inputs.gather(inputs.target_ids).values.tolist() == [1, 2, 3, 4, 2, 2]
    batch.set("prompt_ids", RaggedField.from_lists([[5], [], [9]], torch.int64))
    with pytest.raises(ValueError, match="sample 1 has an empty prompt_ids"):
        pad_inputs(batch)


def test_logprobs_and_entropy_are_those_of_the_tempered_softmax():
    logits = torch.randn(6, VOCAB, dtype=torch.float64) * 3
    targets = torch.randint(0, VOCAB, (6,))
    for temperature in (0.6, 1.0, 1.7):
        probs = torch.softmax(logits / temperature, -1)
        expected = probs[torch.arange(6), targets].log()
        got = token_logprobs(logits, targets, temperature=temperature)
        torch.testing.assert_close(got, expected.float())
        entropy = -(probs * probs.log()).sum(-1)
        torch.testing.assert_close(token_entropy(logits, temperature=temperature),
                                   entropy.float())
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(logits, targets, temperature=0)


def test_temperature_is_validated_where_it_is_configured():
    from peerflow.config.engines import SamplingConfig

    with pytest.raises(ValueError, match="rollout.sampling.temperature=0"):
        SamplingConfig(temperature=0.0)
    engine = TabularEngine(EngineContext(model_path="m", layout=ParallelLayout(),
                                         temperature=0.0), OptimSettings())
    with pytest.raises(ValueError, match="temperature=0.0: log-probs need a positive"):
        engine.forward_logprobs(_batch())


def _vocab_parallel_rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    logits = torch.randn(5, 2 * 6, dtype=torch.float64)  # 12 rows: 11 real + 1 padding
    targets = torch.randint(0, VOCAB, (5,))
    mine = logits[:, rank * 6:(rank + 1) * 6].clone().requires_grad_(True)
    shard = VocabShard(group=dist.group.WORLD, start=rank * 6, vocab_size=VOCAB)
    got = token_logprobs(mine, targets, temperature=0.7, shard=shard)
    got.sum().backward()
    entropy = token_entropy(mine.detach(), temperature=0.7, shard=shard)
    # numpy arrays travel by value (torch tensors would share memory with a dead process)
    queue.put((rank, *(t.detach().numpy() for t in (got, entropy, mine.grad))))
    dist.destroy_process_group()


def test_vocab_parallel_logprobs_match_full_vocabulary_values_and_gradients():
    port = free_port()
    queue = warm_context().Queue()
    procs = start_warm(_vocab_parallel_rank, [(r, port, queue) for r in range(2)])
    results = {r: [torch.from_numpy(a) for a in rest]
               for r, *rest in (queue.get(timeout=120) for _ in procs)}
    assert stop_warm(procs, 60) == [0, 0]
    torch.manual_seed(0)
    logits = torch.randn(5, 12, dtype=torch.float64)[:, :VOCAB].requires_grad_(True)
    targets = torch.randint(0, VOCAB, (5,))
    full = token_logprobs(logits, targets, temperature=0.7)
    full.sum().backward()
    entropy = token_entropy(logits.detach(), temperature=0.7)
    for rank in (0, 1):
        got, got_entropy, grad = results[rank]
        torch.testing.assert_close(got, full.detach().float())
        torch.testing.assert_close(got_entropy, entropy.float())
    grads = torch.cat([results[0][2], results[1][2]], dim=1)
    torch.testing.assert_close(grads[:, :VOCAB], logits.grad, atol=1e-6, rtol=1e-5)
    assert float(grads[:, VOCAB:].abs().max()) == 0.0  # padded row


class TabularEngine(CausalLMTrainEngine):
    """The toolkit over a plain torch module: logits after token `s` are `W[s]`."""

    name = "tabular"

    def __init__(self, context: EngineContext, optim: OptimSettings) -> None:
        super().__init__(context, None, optim)
        self.device = torch.device("cpu")
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(VOCAB, VOCAB)
        self.optimizer = torch.optim.SGD(self.table.parameters(), lr=optim.lr)

    def forward_micro(self, micro: MicroBatch) -> torch.Tensor:
        return self.table(micro.inputs.input_ids)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.table.parameters(), float("inf"))
        self.optimizer.step()
        return float(norm)

    def set_training(self, mode: bool) -> None:
        self.table.train(mode)

    def weight_sources(self):
        return []

    def materialize(self, specs):
        raise NotImplementedError


def _batch() -> Batch:
    g = torch.Generator().manual_seed(3)
    n = 7
    batch = Batch(sample_id=range(n), group_id=[i // 2 for i in range(n)],
                  weight_version=[0] * n)
    batch.set("prompt_ids", [torch.randint(0, VOCAB, (1 + i % 3,), generator=g)
                             for i in range(n)])
    batch.set("response_ids", [torch.randint(0, VOCAB, (1 + (2 * i) % 5,), generator=g)
                               for i in range(n)])
    return batch


def nll_with_entropy_bonus(logprobs, batch, *, global_tokens, global_samples):
    """Token-mean NLL minus 0.1 x token-mean entropy (the entropy carries gradient)."""
    entropy = batch["entropy"].values
    value = (-logprobs.values.sum() - 0.1 * entropy.sum()) / global_tokens
    return value, {"tokens": float(len(logprobs.values))}


nll_with_entropy_bonus.needs_entropy = True


def _train(micro_batch_tokens: int, mini_batches: int = 1):
    optim = OptimSettings(lr=0.5, micro_batch_tokens=micro_batch_tokens,
                          mini_batches=mini_batches)
    context = EngineContext(model_path="unused", layout=ParallelLayout(), temperature=0.6)
    engine = TabularEngine(context, optim)
    metrics = engine.train_step(_batch(), nll_with_entropy_bonus)
    return engine, metrics


def test_train_step_is_the_full_batch_gradient_whatever_the_micro_batches():
    whole, metrics = _train(micro_batch_tokens=1000)
    split, split_metrics = _train(micro_batch_tokens=6)
    torch.testing.assert_close(split.table.weight, whole.table.weight)
    assert set(metrics) == {"tokens", "loss", "entropy", "grad_norm", "lr", "padded_tokens"}
    assert split_metrics["padded_tokens"] < metrics["padded_tokens"]  # one pass pads more
    for key in ("loss", "entropy", "grad_norm"):
        assert split_metrics[key] == pytest.approx(metrics[key], rel=1e-5)

    reference = TabularEngine(EngineContext(model_path="unused", layout=ParallelLayout()),
                              OptimSettings(lr=0.5))
    table = reference.table.weight.detach().clone().requires_grad_(True)
    batch = _batch()
    pieces = [(torch.cat([p, r]), len(p)) for p, r in zip(
        batch.ragged("prompt_ids").rows(), batch.ragged("response_ids").rows(), strict=True)]
    logp, ent = [], []
    for seq, start in pieces:
        logits = table[seq[start - 1:-1]] / 0.6
        logp.append(torch.log_softmax(logits, -1).gather(-1, seq[start:, None])[:, 0])
        probs = torch.softmax(logits, -1)
        ent.append(-(probs * probs.log()).sum(-1))
    tokens = sum(len(x) for x in logp)
    loss = (-torch.cat(logp).sum() - 0.1 * torch.cat(ent).sum()) / tokens
    loss.backward()
    torch.testing.assert_close(whole.table.weight, table.detach() - 0.5 * table.grad)
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert metrics["entropy"] == pytest.approx(float(torch.cat(ent).mean()), rel=1e-5)


def test_forward_logprobs_keeps_batch_order_and_mini_batches_step_separately():
    engine, _ = _train(micro_batch_tokens=6)
    batch = _batch()
    got = engine.forward_logprobs(batch)
    assert got.lengths.tolist() == batch.lengths("response_ids").tolist()
    one = engine.forward_logprobs(batch.select([3]))
    torch.testing.assert_close(got.row(3), one.row(0))
    _, metrics = _train(micro_batch_tokens=6, mini_batches=3)
    assert metrics["lr"] == 0.5 and metrics["grad_norm"] > 0


def test_train_step_trains_only_the_tokens_of_the_loss_mask():
    from peerflow.algorithms.losses import PPOClip, PPOClipOptions
    from peerflow.batch import RaggedField

    batch = _batch()
    g = torch.Generator().manual_seed(5)
    lengths = batch.lengths("response_ids")
    mask = torch.rand(int(lengths.sum()), generator=g) < 0.6
    mask[0] = True
    batch.set("loss_mask", RaggedField(values=mask, offsets=batch.ragged("response_ids").offsets))
    advantages = torch.randn(len(mask), generator=g)
    batch.set("advantages", RaggedField(values=advantages,
                                        offsets=batch.ragged("response_ids").offsets))
    loss = PPOClip(PPOClipOptions(aggregation="seq-mean-token-mean"))

    def trained(b: Batch, micro_batch_tokens: int) -> torch.Tensor:
        engine = TabularEngine(EngineContext(model_path="unused", layout=ParallelLayout(),
                                             temperature=0.6),
                               OptimSettings(lr=0.5, micro_batch_tokens=micro_batch_tokens))
        engine.train_step(b, loss)
        return engine.table.weight.detach()

    got = trained(batch, 1000)
    torch.testing.assert_close(trained(batch, 6), got)  # micro-batching stays exact
    wild = Batch(sample_id=batch.sample_id, group_id=batch.group_id,
                 weight_version=batch.weight_version, fields=dict(batch.fields))
    wild.set("advantages", RaggedField(values=torch.where(mask, advantages, 1e3),
                                       offsets=batch.ragged("response_ids").offsets))
    assert torch.equal(trained(wild, 1000), got)  # observation tokens do not count

    table = TabularEngine(EngineContext(model_path="unused", layout=ParallelLayout()),
                          OptimSettings()).table.weight.detach().clone().requires_grad_(True)
    total = 0.0
    rows = zip(batch.ragged("prompt_ids").rows(), batch.ragged("response_ids").rows(),
               batch.ragged("loss_mask").rows(), batch.ragged("advantages").rows(), strict=True)
    samples = 0
    for prompt, response, keep, adv in rows:
        seq = torch.cat([prompt, response])
        logits = table[seq[len(prompt) - 1:-1]] / 0.6
        logp = torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0]
        if keep.any():  # ratio 1 on-policy: the loss is -A logp, mean over model tokens
            total = total + (-(adv * logp)[keep]).sum() / keep.sum()
            samples += 1
    (total / samples).backward()
    torch.testing.assert_close(got, table.detach() - 0.5 * table.grad)


def test_shared_prompt_layout_runs_each_prompt_once_and_keeps_answers_apart():
    from peerflow.training.shared_prompts import shared_prompt_inputs

    prompts = [[5, 6, 7], [5, 6, 7], [9, 8], [5, 6, 7]]
    responses = [[1, 2], [], [3, 4, 5], [6]]  # an empty answer too
    count = len(prompts)
    batch = Batch(sample_id=torch.arange(count), group_id=torch.tensor([0, 0, 1, 0]),
                  weight_version=torch.zeros(count, dtype=torch.int64))
    batch.set("prompt_ids", [torch.tensor(p) for p in prompts])
    batch.set("response_ids", [torch.tensor(r, dtype=torch.int64) for r in responses])
    inputs = shared_prompt_inputs(batch)
    assert inputs.input_ids.tolist() == [[5, 6, 7, 1, 2, 6], [9, 8, 3, 4, 5, 0]]
    assert inputs.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3]  # each answer after its prompt
    assert torch.equal(inputs.response_targets(), pad_inputs(batch).response_targets())
    allowed = inputs.allowed[0]
    assert allowed[5, :3].all() and not allowed[5, 3:5].any()  # sees the prompt, not answer 1
    assert allowed[4, 3] and not allowed[3, 4]  # causal inside an answer
    # Every response token is read where it is predicted: position ids of the last K.
    per_position = torch.arange(12).reshape(2, 6)[:, -inputs.logits_to_keep:]
    got = inputs.gather(per_position)
    # sample 0: row 0 at the prompt's end (2), then 3; sample 2: row 1 (7, 8, 9);
    # sample 3: row 0, at the prompt's end again
    assert got.values.tolist() == [2, 3, 7, 8, 9, 2]
    assert got.offsets.tolist() == [0, 2, 2, 5, 6]


def test_shared_prompt_rows_stay_within_the_micro_batch_budget():
    from peerflow.training.shared_prompts import shared_prompt_inputs, shared_prompt_units

    prompt = [5, 6, 7, 8]
    answers = [[1] * 3, [2] * 4, [3] * 2, [4] * 12, [9]]
    batch = Batch(sample_id=torch.arange(6), group_id=torch.tensor([0] * 5 + [1]),
                  weight_version=torch.zeros(6, dtype=torch.int64))
    batch.set("prompt_ids", [torch.tensor(prompt)] * 5 + [torch.tensor([3, 3])])
    batch.set("response_ids", [torch.tensor(a) for a in [*answers, [7, 7]]])
    rows, tokens = shared_prompt_units(batch, budget=12)
    # 4 + 3 + 4 fits; + 2 does not, so a second row repeats the prompt; the 12-token
    # answer is over budget alone; the last answer still fits the first row (first fit);
    # the other prompt has a row of its own.
    assert rows == [[0, 1, 4], [2], [3], [5]]
    assert tokens == [12, 6, 16, 4]
    inputs = shared_prompt_inputs(batch.select(rows[0]))
    assert inputs.input_ids.shape == (1, 12)


def test_shared_prompts_need_an_attention_backend_that_takes_4d_masks():
    from types import SimpleNamespace

    from peerflow.training.shared_prompts import takes_custom_masks

    model = torch.nn.Linear(1, 1)
    for backend, takes in [("sdpa", True), ("eager", True), ("flash_attention_2", False)]:
        model.config = SimpleNamespace(_attn_implementation=backend)
        assert takes_custom_masks(model) is takes


def test_a_step_records_its_peak_memory_and_starts_a_new_one():
    from peerflow.training.memory import peak_bytes, record_peak, reset_peak
    from peerflow.worker.metrics import StepMetrics

    cpu = torch.device("cpu")
    reset_peak(cpu)
    held = torch.ones(2**26)  # 256 MiB more resident memory in this step
    held += 1
    del held  # freed (a 256 MiB block is unmapped): the peak still counts it
    metrics = StepMetrics()
    record_peak(metrics, cpu)
    kind, peak, _ = metrics.raw()["memory/peak_rss_gib"]
    assert kind == "max"  # the largest over ranks
    # reset after recording: the new peak is today's RSS, without the 256 MiB
    assert peak > 0.25 and peak_bytes(cpu) / 2**30 < peak - 0.2
