"""What the host computes of an assert: typed comparisons over the program's plain values.

`CheckBuilder` turns an assert's test into a tree the host evaluates itself (see
`peerflow.rewards.assert_harness`): literals stay on the host, comparisons, `and`/`or`/
`not`, arithmetic, subscripts, displays and `HOST_FUNCTIONS` are applied here to decoded
values, and every other sub-expression is a leaf the program evaluates in the sandbox.
`==` and `!=` compare type and value (`same`).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

#: Most elements of one set (or keys of one dict) the host hashes to one value: ints are
#: hashed modulo 2**61 - 1, so a program can send thousands that collide, and building
#: their set costs quadratic time (issue 49's red team: 33,000 took the host 5 s).
MAX_SAME_HASH = 64


def hash_spread(items: Any) -> list[Any]:
    """`items` as a list, checked to be safe to put in a set or a dict's keys.

    Raises:
        ValueError: when more than `MAX_SAME_HASH` of them share one hash.
        TypeError: for an unhashable item (as `set` itself would).
    """
    items = list(items)
    counts: dict[int, int] = {}
    for item in items:
        key = hash(item)
        counts[key] = counts.get(key, 0) + 1
        if counts[key] > MAX_SAME_HASH:
            raise ValueError(f"more than {MAX_SAME_HASH} elements share one hash")
    return items


def _set(items: Any = ()) -> set[Any]:
    return set(hash_spread(items))


def _frozenset(items: Any = ()) -> frozenset[Any]:
    return frozenset(hash_spread(items))


def _dict(items: Any = (), **kwargs: Any) -> dict[Any, Any]:
    pairs = list(items.items() if isinstance(items, dict) else items)
    hash_spread(pair[0] for pair in pairs)
    return dict(pairs, **kwargs)


#: Builtins the host applies itself to decoded values (pure, bounded by their input;
#: `set`, `frozenset` and `dict` refuse many colliding hashes, `hash_spread`).
HOST_FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{f.__name__: f for f in (abs, all, any, bool, float, int, len, list, max, min, round,
                               sorted, str, sum, tuple)},
    "dict": _dict, "frozenset": _frozenset, "set": _set}
#: Longest sequence `*` may build on the host.
MAX_REPEAT = 1_000_000
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_ORDER = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
          ast.GtE: operator.ge}
_SINGLETONS = (None, True, False, Ellipsis)
#: A `%` format the host does not apply: a width or precision from the arguments (`*`),
#: or one of seven digits or more (a program's string could ask for gigabytes).
_WIDE_FORMAT = re.compile(r"%(?:\([^)]*\))?[^a-zA-Z%]*(\*|\d{7,})")


class LeafFailed(Exception):
    """A leaf had no usable value (it raised, timed out, or was not plain data)."""


@attrs.frozen
class Check:
    """One assert: its source and the tree the host evaluates."""

    source: str
    tree: Callable[[Mapping[int, Any]], Any]
    """Evaluates the assert's test from the decoded leaf values (raises when it cannot)."""

    def passes(self, values: Mapping[int, Any]) -> bool:
        """Whether the assert holds for `values` (an error in it is a failure)."""
        try:
            return bool(self.tree(values))
        except Exception:  # noqa: BLE001 - any failure to evaluate fails the assert
            return False


_FLOATS = {"inf": float("inf"), "nan": float("nan")}


def decode(text: str) -> Any:
    """A `repr()` back to its value: literals only, plus `inf`, `nan` and `frozenset(...)`.

    Raises:
        ValueError: (or `SyntaxError`, `TypeError`, `RecursionError`, `MemoryError`) for
            anything that is not plain data.
    """
    return _decoded(ast.parse(text, mode="eval").body)


def _decoded(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _FLOATS:
        return _FLOATS[node.id]
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Name) and node.operand.id == "inf"):
        return -_FLOATS["inf"]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "frozenset" and len(node.args) <= 1 and not node.keywords):
        return _frozenset(_decoded(node.args[0]) if node.args else ())
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_decoded(e) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: _set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        keys = hash_spread(_decoded(k) for k in node.keys)  # type: ignore[arg-type]
        return dict(zip(keys, (_decoded(v) for v in node.values)))
    return ast.literal_eval(node)


def typed(value: Any) -> Any:
    """`value` with every element tagged by its type, so `==` compares type and value."""
    kind = type(value)
    if kind in (list, tuple):
        return kind.__name__, tuple(typed(v) for v in value)
    if kind in (set, frozenset):
        return kind.__name__, frozenset(typed(v) for v in value)
    if kind is dict:
        return "dict", frozenset((typed(k), typed(v)) for k, v in value.items())
    return kind.__name__, value


def same(a: Any, b: Any) -> bool:
    """Equal in type and value, element by element (`1 != 1.0 != True`)."""
    return typed(a) == typed(b)


def _contains(container: Any, item: Any) -> bool:
    if isinstance(container, (str, bytes)):
        if type(item) is not type(container):
            raise TypeError(f"'in <{type(container).__name__}>' needs the same type")
        return item in container
    if isinstance(container, dict):
        container = container.keys()
    return any(same(item, element) for element in container)


def _compare(op: ast.cmpop, left: Any, right: Any) -> bool:
    if isinstance(op, (ast.Eq, ast.NotEq)):
        return same(left, right) == isinstance(op, ast.Eq)
    if isinstance(op, (ast.In, ast.NotIn)):
        return _contains(right, left) == isinstance(op, ast.In)
    if isinstance(op, (ast.Is, ast.IsNot)):
        return (left is right) == isinstance(op, ast.Is)
    return bool(_ORDER[type(op)](left, right))


def _binary(op: ast.operator, left: Any, right: Any) -> Any:
    numbers = (int, float, complex)
    if isinstance(op, ast.Mult) and not (isinstance(left, numbers) and isinstance(
            right, numbers)):
        count, seq = (left, right) if isinstance(left, int) else (right, left)
        if not isinstance(count, int) or len(seq) * max(count, 0) > MAX_REPEAT:
            raise ValueError("repetition too large for the host")
    if isinstance(op, ast.Pow) and (not isinstance(right, (int, float)) or abs(right) * max(
            1, abs(left).bit_length() if isinstance(left, int) else 64) > 2**20):
        raise ValueError("power too large for the host")
    if isinstance(op, ast.Mod) and isinstance(left, (str, bytes)) and _WIDE_FORMAT.search(
            left if isinstance(left, str) else left.decode("latin-1")):
        raise ValueError("format width too large for the host")  # '%1500000000s' % 1
    return _BINARY[type(op)](left, right)


class CheckBuilder:
    """Turns an assert's test into a host tree; what it cannot compute becomes a leaf.

    Each leaf is appended to `steps` as `("eval", source)`, numbered from `first_leaf`.
    """

    def __init__(self, steps: list[tuple[str, str]], first_leaf: int) -> None:
        self.steps = steps
        self.next_leaf = first_leaf

    def leaf(self, node: ast.expr) -> Callable[[Mapping[int, Any]], Any]:
        """A sub-expression the program evaluates: its value is looked up by number."""
        index = self.next_leaf
        self.next_leaf += 1
        self.steps.append(("eval", ast.unparse(node)))

        def value(values: Mapping[int, Any]) -> Any:
            if index not in values:
                raise LeafFailed(index)
            return values[index]
        return value

    def build(self, node: ast.expr) -> Callable[[Mapping[int, Any]], Any]:  # noqa: C901
        """The host tree of `node`: literals, comparisons, boolean and arithmetic here."""
        try:
            constant = ast.literal_eval(node)
            return lambda values: constant
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        if isinstance(node, ast.Compare):
            if any(isinstance(o, (ast.Is, ast.IsNot)) for o in node.ops) and not all(
                    isinstance(c, ast.Constant) and c.value in _SINGLETONS
                    for c in node.comparators):
                return self.leaf(node)  # identity of two program values: theirs to say
            parts = [self.build(n) for n in (node.left, *node.comparators)]
            ops = node.ops

            def compare(values: Mapping[int, Any]) -> bool:
                operands = [p(values) for p in parts]
                return all(_compare(op, a, b)
                           for op, a, b in zip(ops, operands, operands[1:]))
            return compare
        if isinstance(node, ast.BoolOp):
            parts = [self.build(n) for n in node.values]
            is_and = isinstance(node.op, ast.And)

            def boolean(values: Mapping[int, Any]) -> Any:
                for part in parts:
                    result = part(values)
                    if bool(result) != is_and:
                        return result
                return result
            return boolean
        if isinstance(node, ast.UnaryOp):
            inner = self.build(node.operand)
            unary = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos,
                     ast.Invert: operator.invert}[type(node.op)]
            return lambda values: unary(inner(values))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right, op = self.build(node.left), self.build(node.right), node.op
            return lambda values: _binary(op, left(values), right(values))
        return self.compound(node)

    def compound(self, node: ast.expr) -> Callable[[Mapping[int, Any]], Any]:
        """Subscripts, displays and host builtins; anything else is a leaf."""
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            seq, index = self.build(node.value), self.build(node.slice)
            return lambda values: seq(values)[index(values)]
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(
                isinstance(e, ast.Starred) for e in node.elts):
            parts, kind = [self.build(e) for e in node.elts], {
                ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)]
            return lambda values: kind(p(values) for p in parts)
        if isinstance(node, ast.Dict) and None not in node.keys:
            keys = [self.build(k) for k in node.keys]  # type: ignore[arg-type]
            items = [self.build(v) for v in node.values]
            return lambda values: {k(values): v(values) for k, v in zip(keys, items)}
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in HOST_FUNCTIONS and not any(
                    isinstance(a, ast.Starred) for a in node.args)
                and all(k.arg is not None for k in node.keywords)):
            fn = HOST_FUNCTIONS[node.func.id]
            args = [self.build(a) for a in node.args]
            kwargs = {k.arg: self.build(k.value) for k in node.keywords}
            return lambda values: fn(*(a(values) for a in args),
                                     **{k: v(values) for k, v in kwargs.items()})
        return self.leaf(node)
