"""Naming the tensor behind a log-prob mismatch: block bisection, then layout hypotheses.

A layout that is wrong but self-consistent (the engine stores `[q; k; v]`, its
`shard_layout` declares `[k; q; v]`) loads and reads back bit-exact, so only the
engine's behaviour shows it. This module finds where, using nothing but syncs and
`generate` — so it works for engines whose model lives in another process:

1. **Block bisection** with structured weights: a transformer block whose output
   projection (`o_proj`, every `down_proj`) is zero adds nothing to the residual stream,
   so loading weights with the blocks after block k silenced turns the engine into the
   model up to block k. The first block whose enabling makes the engine's log-probs
   leave the reference model's is the culprit (embeddings and LM head come first).
2. **Hypotheses** inside that block: every reordering of the pieces of a fused local
   tensor (what the engine may really store), every swap of two MoE experts (all their
   tensors: a permuted expert order) and every swap of two same-shaped HF tensors (gate
   and up of one expert first). A hypothesis that makes the reference model reproduce the
   engine names the parameter, the region, and what the declared layout claimed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

from peerflow.conformance.oracle import cut
from peerflow.conformance.reference import reference_logprobs
from peerflow.shard import Box, ShardSpec

Rows = list[tuple[tuple[int, ...], tuple[int, ...]]]
#: Syncs `weights` into the engine, samples, returns `(rows, engine log-probs per row)`.
Probe = Callable[[Mapping[str, torch.Tensor]], tuple[Rows, list[torch.Tensor]]]


@attrs.frozen(kw_only=True)
class Block:
    """A part of the model the bisection switches on as a whole."""

    label: str
    """What a failure message calls it (`layer 0 attention`)."""
    names: tuple[str, ...]
    """HF parameters that belong to it."""
    outputs: tuple[str, ...]
    """HF parameters zeroed to silence it (empty: always on)."""


def model_blocks(canonical: Mapping[str, Sequence[int]], num_layers: int) -> list[Block]:
    """Embeddings and head, then each layer's attention and MLP, in forward order."""
    blocks = [Block(label="embeddings, final norm and LM head", outputs=(), names=tuple(
        n for n in canonical if not n.startswith("model.layers.")))]
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        attn = tuple(n for n in canonical if n.startswith(prefix + "self_attn.")
                     or n == prefix + "input_layernorm.weight")
        mlp = tuple(n for n in canonical if n.startswith(prefix + "mlp.")
                    or n == prefix + "post_attention_layernorm.weight")
        blocks.append(Block(label=f"layer {layer} attention", names=attn,
                            outputs=tuple(n for n in attn if ".o_proj." in n)))
        blocks.append(Block(label=f"layer {layer} MLP", names=mlp,
                            outputs=tuple(n for n in mlp if n.endswith("down_proj.weight"))))
    return blocks


def silenced(weights: Mapping[str, torch.Tensor], blocks: Sequence[Block],
             upto: int) -> dict[str, torch.Tensor]:
    """`weights` with every block after `blocks[upto]` contributing nothing."""
    out = dict(weights)
    for block in blocks[upto + 1:]:
        for name in block.outputs:
            out[name] = torch.zeros_like(out[name])
    return out


def gap(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference between two lists of per-token log-probs."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if len(g) != len(w):
            return float("inf")
        if len(g):
            worst = max(worst, float((g.double() - w.double()).abs().max()))
    return worst


def _reorderings(spec: ShardSpec) -> list[ShardSpec]:
    """Every other order of a fused tensor's row-stacked pieces (same sizes)."""
    pieces = sorted(spec.pieces, key=lambda p: p.local_box.offsets[0])
    if len(pieces) < 2 or len(pieces) > 4 or spec.padding:
        return []
    width = tuple(spec.local_shape[1:])
    if any(tuple(p.local_box.sizes[1:]) != width for p in pieces):
        return []
    out = []
    for order in itertools.permutations(pieces):
        if list(order) == pieces:
            continue
        row, moved = 0, []
        for p in order:
            offsets = (row,) + (0,) * len(width)
            moved.append(attrs.evolve(p, local_box=Box(offsets=offsets, sizes=p.local_box.sizes)))
            row += p.local_box.sizes[0]
        out.append(attrs.evolve(spec, pieces=tuple(moved)))
    return out


def describe_pieces(spec: ShardSpec) -> str:
    """`rows [0:64] = k_proj.weight [0:64, 0:128]; …` for one local tensor."""
    parts = []
    for p in sorted(spec.pieces, key=lambda p: p.local_box.offsets[0]):
        lo, size = p.local_box.offsets[0], p.local_box.sizes[0]
        parts.append(f"rows [{lo}:{lo + size}] = {p.name} {p.global_box}")
    return "; ".join(parts)


def _as_engine_sees(weights: Mapping[str, torch.Tensor], declared: ShardSpec,
                    actual: ShardSpec) -> dict[str, torch.Tensor]:
    """HF tensors the engine computes with if it stores `declared` data as `actual`."""
    local = cut(declared, weights)
    out = dict(weights)
    out.update({p.name: weights[p.name].clone() for p in actual.pieces})
    for piece in actual.pieces:
        out[piece.name][piece.global_box.slices()] = local[piece.local_box.slices()]
    return out


def hypotheses(block: Block, specs: Sequence[ShardSpec], weights: Mapping[str, torch.Tensor],
               ) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """`(explanation, HF tensors the engine would compute with)` for likely layout bugs.

    MoE mix-ups come first (two tensors of one expert, then two whole experts), then
    reorderings of fused tensors, then swaps of any two same-shaped tensors.
    """
    names = set(block.names)
    pairs = [(a, b) for a, b in itertools.combinations(sorted(names), 2)
             if a in weights and b in weights and weights[a].shape == weights[b].shape]
    same_expert = [(a, b) for a, b in pairs if _same_expert(a, b)]
    out = [_swap(weights, a, b) for a, b in same_expert]
    out += _expert_swaps(names, specs, weights)
    for spec in specs:
        if not any(p.name in names for p in spec.pieces):
            continue
        for actual in _reorderings(spec):
            out.append((
                f"the engine reads local tensor {spec.local_name!r} as {describe_pieces(actual)}, "
                f"but shard_layout declares {describe_pieces(spec)}. Fix the piece order in "
                "shard_layout (or the engine's storage) so each declared region is the one the "
                "model uses", _as_engine_sees(weights, spec, actual)))
    out += [_swap(weights, a, b) for a, b in pairs if (a, b) not in same_expert]
    return out


def _swap(weights: Mapping[str, torch.Tensor], a: str,
          b: str) -> tuple[str, dict[str, torch.Tensor]]:
    swapped = dict(weights)
    swapped[a], swapped[b] = weights[b], weights[a]
    return (f"the engine uses the data of {a} as {b} and the other way round; "
            "load_weights or shard_layout maps the two names crosswise", swapped)


def _same_expert(a: str, b: str) -> bool:
    ma, mb = _EXPERT.match(a), _EXPERT.match(b)
    return bool(ma and mb and ma.group(1, 2) == mb.group(1, 2))


_EXPERT = re.compile(r"^(model\.layers\.\d+\.\w+\.experts\.)(\d+)(\..+)$")


def _expert_swaps(names: set[str], specs: Sequence[ShardSpec],
                  weights: Mapping[str, torch.Tensor],
                  ) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Hypotheses that the engine holds two MoE experts of a layer in each other's place."""
    experts: dict[tuple[str, int], list[str]] = {}
    for name in sorted(names):
        match = _EXPERT.match(name)
        if match and name in weights:
            experts.setdefault((match.group(1), int(match.group(2))), []).append(name)
    out = []
    for (pa, a), (pb, b) in itertools.combinations(sorted(experts), 2):
        if pa != pb:
            continue
        swapped = dict(weights)
        for name in experts[(pa, a)]:
            other = f"{pa}{b}{name[len(pa) + len(str(a)):]}"
            if other not in weights or weights[other].shape != weights[name].shape:
                break
            swapped[name], swapped[other] = weights[other], weights[name]
        else:
            held = sorted({s.local_name for s in specs for p in s.pieces
                           if p.name in experts[(pa, a)]})
            out.append((f"the engine computes expert {a} ({', '.join(experts[(pa, a)])}) with "
                        f"expert {b}'s tensors and the other way round: local tensors {held} "
                        "store the experts in another order than shard_layout declares. Fix "
                        "the expert order of their pieces in shard_layout (or the engine's "
                        "storage)", swapped))
    return out


def diagnose(probe: Probe, config: object, weights: Mapping[str, torch.Tensor],
             specs: Sequence[ShardSpec], *, atol: float) -> str:
    """Explains why the engine's log-probs differ from the reference model's.

    Args:
        probe: Syncs HF tensors into the engine and samples (temperature 1).
        config: `transformers` config of the model.
        weights: HF tensors whose sync showed the mismatch.
        specs: The engine's `weight_targets()`.
        atol: Log-prob tolerance.

    Returns:
        A message naming the block and, when a hypothesis reproduces the engine, the
        parameter and region at fault.
    """
    canonical = {n: tuple(t.shape) for n, t in weights.items()}
    blocks = model_blocks(canonical, int(getattr(config, "num_hidden_layers", 0)))
    for k, block in enumerate(blocks):
        probe_weights = silenced(weights, blocks, k)
        rows, got = probe(probe_weights)
        worst = gap(got, reference_logprobs(config, probe_weights, rows))
        if worst <= atol:
            continue
        where = (f"with only the blocks up to {block.label} active, log-probs differ from the "
                 f"reference by {worst:.2e}: the weights of {block.label} "
                 f"({', '.join(block.names)}) are used differently from how shard_layout "
                 "declares them")
        for explanation, seen in hypotheses(block, specs, probe_weights):
            if gap(got, reference_logprobs(config, seen, rows)) <= atol:
                return f"{where}. Reproduced exactly when {explanation}."
        declared = [f"{s.local_name}: {describe_pieces(s)}" for s in specs
                    if any(p.name in block.names for p in s.pieces)]
        return f"{where}. Declared layout of that block:\n    " + "\n    ".join(declared)
    return ("every block matches the reference on its own; the mismatch comes from how "
            "blocks combine (e.g. the residual stream or rotary positions)")
