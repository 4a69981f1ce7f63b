import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peerflow.batch import Batch, RaggedField


def make_batch(lengths, with_objects=True):
    n = len(lengths)
    batch = Batch(sample_id=torch.arange(n) + 100, group_id=torch.arange(n) // 2,
                  weight_version=torch.full((n,), 3))
    batch.set("response_ids",
              [torch.arange(k, dtype=torch.int64) + i for i, k in enumerate(lengths)])
    batch.set("reward", torch.linspace(0, 1, n))
    if with_objects:
        batch.set_objects("answer", [f"a{i}" for i in range(n)])
    return batch


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.data())
def test_select_concat_and_wire_round_trip(lengths, data):
    batch = make_batch(lengths)
    order = data.draw(st.permutations(range(len(lengths))))
    chosen = batch.select(order)
    assert chosen.sample_id.tolist() == [100 + i for i in order]
    for position, index in enumerate(order):
        assert torch.equal(chosen.ragged("response_ids").row(position),
                           batch.ragged("response_ids").row(index))
        assert chosen["answer"][position] == f"a{index}"
    split = data.draw(st.integers(0, len(order)))
    joined = Batch.concat([chosen.select(range(split)), chosen.select(range(split, len(order)))])
    rebuilt = Batch.from_wire(*joined.to_wire())
    assert rebuilt.sample_id.tolist() == chosen.sample_id.tolist()
    assert torch.equal(rebuilt.ragged("response_ids").values, chosen.ragged("response_ids").values)
    assert torch.equal(rebuilt["reward"], chosen["reward"])
    assert rebuilt["answer"] == chosen["answer"]


def test_unknown_fields_travel_untouched():
    batch = make_batch([2, 3])
    batch.set("my_custom_field", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    rebuilt = Batch.from_wire(*batch.to_wire())
    assert torch.equal(rebuilt["my_custom_field"], batch["my_custom_field"])


def test_to_padded_and_mask():
    batch = make_batch([1, 3], with_objects=False)
    padded, mask = batch.to_padded("response_ids", pad_value=-1)
    assert padded.tolist() == [[0, -1, -1], [1, 2, 3]]
    assert mask.tolist() == [[True, False, False], [True, True, True]]


def test_field_length_mismatch_is_rejected():
    batch = make_batch([1, 2])
    with pytest.raises(ValueError, match="has 3 samples but the batch has 2"):
        batch.set("reward", torch.zeros(3))


def test_missing_field_error_names_available_fields():
    with pytest.raises(KeyError, match="has no field 'advantages'"):
        make_batch([1])["advantages"]


def test_concat_rejects_different_fields():
    a, b = make_batch([1]), make_batch([2], with_objects=False)
    with pytest.raises(ValueError, match="same fields"):
        Batch.concat([a, b])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(-5, 50), max_size=6), max_size=8))
def test_from_lists_packs_like_from_tensors(rows):
    packed = RaggedField.from_lists(rows, torch.int64)
    expected = RaggedField.from_tensors([torch.tensor(r, dtype=torch.int64) for r in rows],
                                        dtype=torch.int64)
    assert packed.values.dtype == torch.int64
    assert torch.equal(packed.values, expected.values)
    assert torch.equal(packed.offsets, expected.offsets)


def test_ragged_lengths():
    field = RaggedField.from_tensors([torch.zeros(2), torch.zeros(0), torch.zeros(5)])
    assert field.lengths.tolist() == [2, 0, 5]
    assert len(field) == 3


def test_concat_and_gather_promote_mixed_dtypes_like_torch_cat():
    ints = Batch(sample_id=[0, 1], group_id=[0, 0], weight_version=[0, 0],
                 fields={"reward": torch.tensor([1, 2])})
    floats = Batch(sample_id=[2], group_id=[1], weight_version=[0],
                   fields={"reward": torch.tensor([0.5])})
    joined = Batch.concat([ints, floats]).fields["reward"]
    assert joined.dtype == torch.float32 and joined.tolist() == [1.0, 2.0, 0.5]
    picked = Batch.gather([(ints, [1]), (floats, [0])]).fields["reward"]
    assert picked.dtype == torch.float32 and picked.tolist() == [2.0, 0.5]
