"""Routing replay: one controller every train engine uses to force MoE routes.

A mixture-of-experts trainer and the rollout engine can send the same token to different
experts (other kernels, dtypes, batch shapes); the trainer's log-probs of the sampled
tokens then differ from the rollout's far more than for a dense model. Routing replay
forces the trainer's forward to use recorded routes while the gate weights still come
from the live router (`peerflow.models.moe_routers.route`), so the router keeps learning:

* `r3` — the routes the rollout engine chose, the batch field `ROUTES`
  (`routed_experts`, int16 `[tokens, layers, top_k]` over prompt + response tokens,
  logical expert ids, -1 where there is no route), replayed in the old-log-prob pass and
  in every update pass;
* `r2` — the trainer's own routes, recorded in its old-log-prob pass
  (`forward_logprobs`, which adds them to the batch as `OLD_ROUTES`, so they travel with
  their samples wherever the coordinator sends them) and replayed in the update passes;
* `off` — native routing; the load-balancing loss and its metrics still work.

`RoutingReplay.attach(model, mode)` rebinds the `forward` of every router of a stock
`transformers` MoE model (the experts modules are untouched). The toolkit
(`CausalLMTrainEngine.run_micro_batches`) opens `scope(...)` around each micro-batch's
forward *and* backward, so a block recomputed under activation checkpointing replays the
same routes. It fails closed: routes whose token count, layer count or top-k differ from
the model's are an error naming the sample; a token whose route is -1 routes natively
(and is counted in `moe/rows_without_routes`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Literal

import attrs
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.errors import ConfigError
from peerflow.models.moe_routers import RouterRule, find_routers, route, rule_of
from peerflow.routes import ROUTES, route_bytes

#: Values of `trainer.routing_replay`.
MODES = ("off", "r2", "r3")
Mode = Literal["off", "r2", "r3"]


def _checked_mode(mode: Mode | bool) -> Mode:
    """`mode`, with YAML's bare `off` (read as `False`) as `off`.

    Raises:
        ConfigError: not one of `MODES`.
    """
    mode = "off" if mode is False else mode
    if mode not in MODES:
        raise ConfigError(f"trainer.routing_replay={mode!r}; choose one of {list(MODES)}.")
    return mode


@attrs.define(eq=False)
class _Stats:
    """Per-step counters behind the `moe/*` metrics."""

    replayed: dict[int, int] = attrs.field(factory=dict)
    no_overlap: dict[int, int] = attrs.field(factory=dict)
    differ: int = 0
    without_routes: int = 0
    routed_tokens: int = 0
    aux: list[float] = attrs.field(factory=list)
    violation: dict[int, list[float]] = attrs.field(factory=dict)


@attrs.define(eq=False)
class RoutingReplay:
    """Forces, records and measures the routes of one MoE model's routers."""

    mode: Mode
    """`off`, `r2` or `r3` (`trainer.routing_replay`)."""
    num_layers: int
    """Decoder layers of the model (the routes' second dimension; dense layers are -1)."""
    top_k: int
    """Experts per token."""
    num_experts: int
    """Experts per sparse layer."""
    sparse_layers: tuple[int, ...]
    """Layers that have a router."""
    _forced: torch.Tensor | None = None
    _real: torch.Tensor | None = None
    _recorded: dict[int, torch.Tensor] | None = None
    _logits: dict[int, torch.Tensor] = attrs.field(factory=dict)
    _layer_stats: dict[int, torch.Tensor] = attrs.field(factory=dict)
    _store: dict[int, torch.Tensor] = attrs.field(factory=dict)
    _stats: _Stats = attrs.field(factory=_Stats)

    @classmethod
    def attach(cls, model: torch.nn.Module, mode: Mode = "off") -> RoutingReplay | None:
        """Rebinds every router's `forward` of `model`; `None` for a dense model.

        Raises:
            ConfigError: `mode` is not one of `MODES`, or is `r2`/`r3` on a dense model.
        """
        mode = _checked_mode(mode)
        routers = list(find_routers(model))
        if not routers:
            if mode != "off":
                raise ConfigError(
                    f"trainer.routing_replay={mode!r} needs a mixture-of-experts model, but "
                    f"{type(model).__name__} has no MoE router; set trainer.routing_replay: off.")
            return None
        config = getattr(model, "config", None)
        layers = int(getattr(config, "num_hidden_layers", 0) or 0) or 1 + max(
            layer for layer, _, _ in routers)
        first = routers[0][2]
        # the routers' own counts: a ZeRO-3-partitioned weight has no rows outside forward
        controller = cls(mode=mode, num_layers=layers, top_k=int(first.top_k),
                         num_experts=int(first.num_experts),
                         sparse_layers=tuple(layer for layer, _, _ in routers))
        for layer, _, module in routers:
            module.forward = functools.partial(controller._route, layer, module, rule_of(module))
        return controller

    @classmethod
    def hooked(cls, mode: Mode, *, num_layers: int, top_k: int, num_experts: int,
               sparse_layers: tuple[int, ...]) -> RoutingReplay:
        """A controller for routers an adapter hooks itself (Megatron's native replay hook).

        The adapter's hook asks `forced_routes(layer)` which experts to use and reports
        every routing with `observe(...)`; everything else (scopes, r2 store, aux loss,
        metrics) is the same as for `attach`.

        Raises:
            ConfigError: `mode` is not one of `MODES`.
        """
        return cls(mode=_checked_mode(mode), num_layers=num_layers, top_k=top_k,
                   num_experts=num_experts, sparse_layers=tuple(sparse_layers))

    # -- the rebound router ---------------------------------------------------------------

    def _route(self, layer: int, module: torch.nn.Module, rule: RouterRule,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        forced = self.forced_routes(layer)
        logits, weights, indices, native = route(module, rule, hidden, forced)
        self.observe(layer, logits, native, forced)
        return logits, weights, indices

    def forced_routes(self, layer: int) -> torch.Tensor | None:
        """The routes to force on `layer` in the open scope (`[tokens, top_k]`), or `None`."""
        return None if self._forced is None else self._forced[:, layer]

    def observe(self, layer: int, logits: torch.Tensor, native: torch.Tensor,
                forced: torch.Tensor | None) -> None:
        """Records one router's forward: its logits (aux loss), native top-k and replay stats.

        Args:
            layer: The decoder layer.
            logits: Router logits `[tokens, experts]` (with gradient), tokens in the
                order of the scope's routes (`input_ids` flattened).
            native: The router's own top-k `[tokens, top_k]`.
            forced: What `forced_routes(layer)` returned.
        """
        if self._recorded is not None:
            self._recorded[layer] = native.detach()
        self._logits[layer] = logits
        if forced is not None:
            known = (forced >= 0).all(dim=-1)
            real = torch.ones_like(known) if self._real is None else self._real.reshape(-1).bool()
            overlap = (native[:, :, None] == forced[:, None, :].long()).any(-1).any(-1)
            differ = (native.sort(-1).values != forced.long().sort(-1).values).any(-1)
            # keyed by layer: a block recomputed in backward overwrites, never double-counts;
            # counted on the device, read once per micro-batch
            self._layer_stats[layer] = torch.stack([known.sum(), (known & ~overlap).sum(),
                                                    (real & ~known).sum(),
                                                    (known & differ).sum()])

    # -- scopes the toolkit opens ----------------------------------------------------------

    @contextlib.contextmanager
    def forcing(self, forced: torch.Tensor | None, *, record: bool = False,
                real: torch.Tensor | None = None) -> Iterator[None]:
        """Routes the forwards inside with `forced` `[tokens, layers, top_k]` (or natively).

        Args:
            forced: Expert ids per token of the forward (its `input_ids` flattened), on
                the model's device; `None` routes natively.
            record: Keep the native routes (`recorded()`).
            real: Non-zero on the forward's non-padding tokens (`[B, L]` attention mask or
                `[tokens]`), for the aux loss and metrics; `None`: every token.
        """
        if forced is not None and (forced.ndim != 3 or forced.shape[1:] != (self.num_layers,
                                                                            self.top_k)):
            raise ValueError(f"routes of shape {tuple(forced.shape)} do not fit the model: "
                             f"expected [tokens, {self.num_layers} layers, top_k={self.top_k}].")
        self._forced, self._recorded = forced, ({} if record else None)
        self._logits, self._layer_stats = {}, {}
        self._real = real
        try:
            yield
        finally:
            self._commit()
            self._forced = None

    def _commit(self) -> None:
        stats = self._stats
        for layer, counts in self._layer_stats.items():
            known, missed, unknown, differ = counts.tolist()
            stats.differ += differ
            stats.replayed[layer] = stats.replayed.get(layer, 0) + known
            stats.no_overlap[layer] = stats.no_overlap.get(layer, 0) + missed
            stats.without_routes += unknown
            stats.routed_tokens += known + unknown
        self._layer_stats = {}

    def recorded(self) -> torch.Tensor:
        """The native routes of the last `forcing(record=True)` forward.

        Returns:
            `[tokens, layers, top_k]` int16, -1 on layers without a router.
        """
        if not self._recorded:
            raise RuntimeError("no routes recorded: open forcing(record=True) around a forward.")
        tokens = next(iter(self._recorded.values())).shape[0]
        device = next(iter(self._recorded.values())).device
        out = torch.full((tokens, self.num_layers, self.top_k), -1, dtype=torch.int16,
                         device=device)
        for layer, indices in self._recorded.items():
            out[:, layer] = indices.to(torch.int16)
        return out

    # -- load balance ----------------------------------------------------------------------

    def aux_loss(self) -> torch.Tensor | None:
        """The Switch-Transformer load-balancing loss of the last forward (with gradient).

        `E * sum_e f_e * P_e` summed over sparse layers' tokens as transformers'
        `load_balancing_loss_func` computes it (non-padding tokens only); also tallies the
        per-layer load violation (`max_e load_e / mean_e load_e - 1`) for the metrics.
        """
        if not self._logits:
            return None
        real = self._real
        assigned = torch.zeros(self.num_experts, dtype=torch.float32)
        prob_sum = torch.zeros(self.num_experts, dtype=torch.float32)
        rows = 0.0
        first = next(iter(self._logits.values()))
        assigned, prob_sum = assigned.to(first.device), prob_sum.to(first.device)
        weight = None if real is None else real.reshape(-1).to(first.device, torch.float32)
        for layer, logits in sorted(self._logits.items()):
            probs = torch.softmax(logits.float(), dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
            w = torch.ones(len(probs), device=probs.device) if weight is None else weight
            load = torch.zeros_like(assigned).scatter_add_(
                0, chosen.reshape(-1), w.repeat_interleave(self.top_k))
            assigned = assigned + load
            prob_sum = prob_sum + (probs * w[:, None]).sum(0)
            rows += float(w.sum())
            mean = float(load.mean())
            if mean > 0:
                self._stats.violation.setdefault(layer, []).append(float(load.max()) / mean - 1)
        if rows == 0:
            return None
        loss = self.num_experts * torch.sum((assigned / rows) * (prob_sum / rows))
        self._stats.aux.append(float(loss.detach()))
        return loss

    # -- r2 --------------------------------------------------------------------------------

    def store(self, sample_ids: torch.Tensor, routes: RaggedField) -> None:
        """Keeps the trainer's own routes of these samples until `take` (r2)."""
        values = routes.values.cpu()
        for i, sample in enumerate(sample_ids.tolist()):
            self._store[int(sample)] = values[int(routes.offsets[i]):int(routes.offsets[i + 1])]

    def take(self, batch: Batch) -> RaggedField:
        """The routes recorded for `batch`'s samples, in its order, and forgets them.

        Raises:
            KeyError: a sample has none (its pass did not run under `forcing(record=True)`).
        """
        missing = [int(s) for s in batch.sample_id.tolist() if int(s) not in self._store]
        if missing:
            raise KeyError(f"no recorded routes for samples {missing[:5]}.")
        rows = [self._store.pop(int(s)) for s in batch.sample_id.tolist()]
        if not rows:
            return RaggedField(values=torch.empty((0, self.num_layers, self.top_k),
                                                  dtype=torch.int16),
                               offsets=torch.zeros(1, dtype=torch.int64))
        return RaggedField.from_tensors(rows, dtype=torch.int16)

    # -- metrics ---------------------------------------------------------------------------

    def step_metrics(self, batch: Batch | None = None,
                     group: object | None = None) -> dict[str, float]:
        """The step's `moe/*` metrics over the ranks of `group`, and resets the counters.

        Collective over `group` (the dp group; `None`: this rank alone): counts are summed
        over the ranks before the shares are taken.

        * `moe/replay_no_overlap` — share of replayed (token, layer) routes whose native
          top-k shares no expert with the replayed set (per layer: `…/layer_{L}`);
        * `moe/replay_changed` — share of replayed routes whose native top-k set differs
          from the replayed one in at least one expert;
        * `moe/rows_without_routes` — share of routed (token, layer) pairs that routed
          natively for want of a route (-1) while replay was on (padding not counted);
        * `moe/aux_loss` — mean load-balancing loss of the step's forwards;
        * `moe/load_violation` — mean over layers of `max load / mean load - 1`;
        * `moe/route_bytes` — bytes of the routes field of `batch` (summed over ranks).
        """
        from peerflow.training.collectives import all_reduce_sum

        stats, layers = self._stats, self.sparse_layers
        mine = [stats.replayed.get(layer, 0) for layer in layers]
        mine += [stats.no_overlap.get(layer, 0) for layer in layers]
        mine += [sum(v) for v in (stats.violation.get(layer, []) for layer in layers)]
        mine += [len(stats.violation.get(layer, [])) for layer in layers]
        mine += [stats.differ, stats.without_routes, stats.routed_tokens, sum(stats.aux),
                 len(stats.aux), route_bytes(batch) if batch is not None else 0,
                 int(batch is not None and ROUTES in batch)]
        total = all_reduce_sum(mine, group)
        n = len(layers)
        replayed, missed = total[:n], total[n:2 * n]
        violation, violations = total[2 * n:3 * n], total[3 * n:4 * n]
        differ, without, routed, aux, auxes, nbytes, has_routes = total[4 * n:]
        out: dict[str, float] = {}
        if has_routes:
            out["moe/route_bytes"] = nbytes
        if sum(replayed):
            out.update({f"moe/replay_no_overlap/layer_{layer}": m / r
                        for layer, m, r in zip(layers, missed, replayed, strict=True) if r})
            out["moe/replay_no_overlap"] = sum(missed) / sum(replayed)
            out["moe/replay_changed"] = differ / sum(replayed)
        if routed and self.mode != "off":
            out["moe/rows_without_routes"] = without / routed
        if auxes:
            out["moe/aux_loss"] = aux / auxes
        means = [v / c for v, c in zip(violation, violations, strict=True) if c]
        if means:
            out["moe/load_violation"] = sum(means) / len(means)
        self._stats = _Stats()
        return out
