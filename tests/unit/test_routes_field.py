"""`routes_column`: rollout results' routes become one int16 ragged field, never truncated."""

from __future__ import annotations

import pytest
import torch

from peerflow.engines import GenerationResult
from peerflow.routes import routes_column


def _result(index: int, tokens: int, routes: torch.Tensor | None) -> GenerationResult:
    return GenerationResult(request_id=0, index=index, token_ids=range(tokens),
                            routed_experts=routes)


def test_results_without_routes_give_no_field():
    assert routes_column([_result(0, 3, None)], [2]) is None


def test_a_result_without_routes_among_others_gets_minus_one_rows():
    routes = torch.arange(5 * 2 * 2, dtype=torch.int16).reshape(5, 2, 2)
    field = routes_column([_result(0, 3, routes), _result(1, 1, None)], [2, 2])
    assert field.values.dtype == torch.int16 and field.lengths.tolist() == [5, 3]
    assert torch.equal(field.row(0), routes) and bool((field.row(1) == -1).all())


def test_a_route_count_that_is_not_the_token_count_is_an_error():
    with pytest.raises(ValueError, match="4 routes for 2 prompt \\+ 3 answer tokens"):
        routes_column([_result(0, 3, torch.zeros(4, 2, 2, dtype=torch.int16))], [2])
    with pytest.raises(ValueError, match="different \\[layers, top_k\\]"):
        routes_column([_result(0, 1, torch.zeros(3, 2, 2, dtype=torch.int16)),
                       _result(1, 1, torch.zeros(3, 2, 1, dtype=torch.int16))], [2, 2])
