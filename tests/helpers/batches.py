"""Batches made on the spot in tests."""

from __future__ import annotations

import torch

from peerflow.batch import Batch, RaggedField


def group_batch(group_id: int, lengths: list[int], first_sid: int, version: int = 0) -> Batch:
    """One prompt group: samples `first_sid`, `first_sid + 1`, … of weight `version`, each a
    2-token prompt and a response of `lengths[i]` tokens (`0, 1, …`)."""
    n = len(lengths)
    return Batch(
        sample_id=torch.arange(first_sid, first_sid + n),
        group_id=torch.full((n,), group_id),
        weight_version=torch.full((n,), version),
        fields={
            "prompt_ids": RaggedField.from_tensors([torch.ones(2, dtype=torch.int64)] * n),
            "response_ids": RaggedField.from_tensors([torch.arange(length) for length in lengths]),
        },
    )
