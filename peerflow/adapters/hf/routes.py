"""The hf engine's record of a mixture-of-experts model's routes during generation (R3).

Every forward of the decode loop runs with the model's routers under the routing-replay
controller in recording mode (`RoutingReplay.forcing(None, record=True)`: native routing,
routes kept). The prefill's routes give each sample its prompt tokens' experts (the n
samples of a prompt share them, as they share its cache rows); each decode step gives the
experts of the token it fed, for the rows still sampling. The last sampled token is never
fed, so its route is -1 — as is every route of a dense model's layers without a router.
A result's routes cover its prompt + answer tokens, `[tokens, layers, top_k]` int16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from peerflow.training.routing_replay import RoutingReplay


class GenerationRoutes:
    """Records routes of one model's generation calls; inert for a dense model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.controller = RoutingReplay.attach(model, "off")

    @property
    def active(self) -> bool:
        """Whether the model has MoE routers (routes are recorded)."""
        return self.controller is not None

    @contextlib.contextmanager
    def call(self) -> Iterator[list[torch.Tensor]]:
        """Yields a list that holds the forward's routes `[rows * width, layers, k]` after it."""
        box: list[torch.Tensor] = []
        if self.controller is None:
            yield box
            return
        with self.controller.forcing(None, record=True):
            yield box
            box.append(self.controller.recorded().cpu())
        self.controller.step_metrics()  # generation keeps no statistics

    def prefill(self, rows: Sequence[Any], routes: list[torch.Tensor],
                prompts: Sequence[Sequence[int]], expand: Sequence[int], width: int) -> None:
        """Gives every row its prompt's routes (left-padded prefill of unique prompts)."""
        if not routes:
            return
        grid = routes[0].reshape(len(prompts), width, *routes[0].shape[1:])
        for row, prompt in zip(rows, expand, strict=True):
            row.routes = [grid[prompt, width - len(prompts[prompt]):]]

    def decode(self, rows: Sequence[Any], active: Sequence[int],
               routes: list[torch.Tensor]) -> None:
        """Appends the routes of the tokens a decode step fed, for rows still sampling."""
        if not routes:
            return
        per_row = routes[0].reshape(len(active), -1, *routes[0].shape[1:])
        for i, index in enumerate(active):
            if not rows[index].done:
                rows[index].routes.append(per_row[i])

    def result(self, row: Any, keep: int) -> torch.Tensor | None:
        """The routes of `row`'s prompt and first `keep` answer tokens (-1 where not fed)."""
        if self.controller is None:
            return None
        tokens = len(row.prompt) + keep
        routes = torch.cat(row.routes)[:tokens]
        missing = tokens - len(routes)
        if missing:
            pad = routes.new_full((missing, *routes.shape[1:]), -1)
            routes = torch.cat([routes, pad])
        return routes
