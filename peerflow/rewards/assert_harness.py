"""Assert-style tests judged on the host: the program only answers, it never grades itself.

A test string such as `assert fib(10) == 55` used to run as `program + tests` and pass on
exit status 0, so `raise SystemExit(0)`, `os._exit(0)`, an object whose `__eq__` is always
true, or a program that read the asserts from its own file scored 1. Now:

* `parse_asserts` splits the tests with `ast` on the host. Every `assert` becomes a
  `Check`: a tree the host evaluates itself — comparisons (`==` and `!=` by type and
  value: `55`, `55.0` and `True` differ), `and`/`or`/`not`, arithmetic, subscripts,
  displays and a few pure builtins (`HOST_FUNCTIONS`) — whose leaves are literals
  (`ast.literal_eval`, kept on the host: an expected value never enters the sandbox) or
  expressions the program must evaluate (`fib(10)`). Other statements (imports, helper
  definitions) run in the program's namespace, in order.
* `HARNESS`, a constant program, runs in the sandbox: it reads a request (a per-call
  random sentinel, the setup statements and the leaf expressions; no expected value) from
  stdin and then points stdin and stdout at `/dev/null`, imports the program as the module
  `solution` in a namespace of its own (any `BaseException`, `SystemExit` included, fails
  every test), evaluates each leaf, and prints one `<sentinel> {json}` line per leaf with
  `repr()` of its value. A leaf that raises or runs past the deadline fails alone.
* `count_passed` decodes each value with `ast.literal_eval` only (an object that is not
  plain data fails) and evaluates the checks. A leaf without a line (the program exited,
  crashed or was killed first) fails.

Whatever the program does to the harness in its own process, what reaches the host is at
most a claimed value for each leaf — the answer a program computing it would give. The
score is the fraction of asserts that pass.

What this cannot decide: a comparison both of whose sides the program computes
(`f(x) == g(x)`), and any part of an expression the host does not compute itself (a call
to a function the tests define, `math.sqrt(...)`), are only as honest as the program's
process; statements of the tests (`expected = [...]`) run in the program's namespace, so
their values are visible to it.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Mapping
from typing import Any

import attrs

#: Builtins the host applies itself to decoded values (pure, bounded by their input).
HOST_FUNCTIONS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    abs, all, any, bool, dict, float, frozenset, int, len, list, max, min, round, set,
    sorted, str, sum, tuple)}
#: Longest `repr()` of one value the host decodes.
MAX_VALUE_CHARS = 200_000
#: Longest sequence `*` may build on the host.
MAX_REPEAT = 1_000_000
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_ORDER = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
          ast.GtE: operator.ge}
_SINGLETONS = (None, True, False, Ellipsis)

#: The sandboxed program (the candidate is appended as `PROGRAM`); see the module docstring.
HARNESS = r'''
import json, os, signal, sys, time, types
request = json.loads(sys.stdin.read())
deadline = time.monotonic() + request["seconds"]
SENTINEL = request["sentinel"]
out = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
try:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
except OSError:  # a sandbox that allows writes only in its own directory
    os.dup2(os.open(".program-output", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
del request["sentinel"]

def report(record):
    out.write(SENTINEL + " " + json.dumps(record) + "\n")
    out.flush()

class Late(BaseException):
    pass

def late(signum, frame):
    raise Late()

def bounded(fn):
    left = deadline - time.monotonic()
    if left <= 0:
        raise Late()
    signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, left)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)

def name(exc):
    try:
        return str(type(exc).__name__)[:100]
    except BaseException:
        return "error"

solution = types.ModuleType("solution")
solution.__file__ = "solution.py"
sys.modules["solution"] = solution
try:
    bounded(lambda: exec(compile(PROGRAM, "solution.py", "exec"), solution.__dict__))
    report({"import": True})
except BaseException as exc:
    report({"import": False, "error": name(exc)})
    out.close()
    os._exit(0)
leaf = 0
for kind, source in request["steps"]:
    try:
        if kind == "exec":
            bounded(lambda: exec(compile(source, "<tests>", "exec"), solution.__dict__))
            continue
        value = bounded(lambda: eval(compile(source, "<tests>", "eval"), solution.__dict__))
        report({"leaf": leaf, "value": bounded(lambda: repr(value))[:MAX + 1]})
    except BaseException as exc:
        if kind == "eval":
            report({"leaf": leaf, "error": name(exc)})
    leaf += kind == "eval"
out.close()
os._exit(0)
'''


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


@attrs.frozen
class AssertPlan:
    """The tests split for the harness (`steps`) and for the host (`checks`)."""

    steps: tuple[tuple[str, str], ...]
    """`("exec", statement)` or `("eval", leaf expression)`, in the tests' order."""
    checks: tuple[Check, ...]


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
    if isinstance(op, ast.Pow) and (not isinstance(right, (int, float)) or abs(right) > 4096):
        raise ValueError("exponent too large for the host")
    return _BINARY[type(op)](left, right)


class _Builder:
    """Turns an assert's test into a host tree, collecting the leaves the program evaluates."""

    def __init__(self, steps: list[tuple[str, str]], first_leaf: int) -> None:
        self.steps = steps
        self.next_leaf = first_leaf

    def leaf(self, node: ast.expr) -> Callable[[Mapping[int, Any]], Any]:
        index = self.next_leaf
        self.next_leaf += 1
        self.steps.append(("eval", ast.unparse(node)))

        def value(values: Mapping[int, Any]) -> Any:
            if index not in values:
                raise LeafFailed(index)
            return values[index]
        return value

    def build(self, node: ast.expr) -> Callable[[Mapping[int, Any]], Any]:  # noqa: C901
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


def parse_asserts(tests: str) -> AssertPlan:
    """Splits a string of Python tests into harness steps and host checks.

    Raises:
        ValueError: when the tests are not valid Python or hold no `assert`.
    """
    try:
        module = ast.parse(tests)
    except SyntaxError as exc:
        raise ValueError(f"the example's assert tests are not valid Python ({exc}); fix the "
                         "`tests` column") from exc
    steps: list[tuple[str, str]] = []
    checks: list[Check] = []
    builder = _Builder(steps, 0)
    for statement in module.body:
        if isinstance(statement, ast.Assert):
            checks.append(Check(source=ast.unparse(statement),
                                tree=builder.build(statement.test)))
        else:
            steps.append(("exec", ast.unparse(statement)))
    if not checks:
        raise ValueError("the example's tests hold no `assert` statement; write tests as "
                         "`assert f(x) == expected` lines or [{input, output}, ...] pairs")
    return AssertPlan(steps=tuple(steps), checks=tuple(checks))


def harness_program(program: str) -> str:
    """The sandboxed program: `HARNESS` with the candidate `program` as a string literal."""
    return f"PROGRAM = {program!r}\nMAX = {MAX_VALUE_CHARS}\n" + HARNESS


def harness_request(plan: AssertPlan, sentinel: str, seconds: float) -> str:
    """The harness's stdin: the sentinel, the steps and its own deadline in seconds."""
    return json.dumps({"sentinel": sentinel, "seconds": seconds,
                       "steps": [list(step) for step in plan.steps]})


def read_values(stdout: str, sentinel: str) -> dict[int, Any] | None:
    """The decoded leaf values in the harness's lines; `None` when the program did not import.

    Only lines that start with `sentinel` count, the first one for each leaf; values are
    decoded with `ast.literal_eval` alone (anything but plain data is left out).
    """
    imported, values, seen = False, {}, set()
    for line in stdout.splitlines():
        if not line.startswith(sentinel + " "):
            continue
        try:
            record = json.loads(line[len(sentinel) + 1:])
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("import") is True:
            imported = True
        leaf = record.get("leaf")
        if type(leaf) is not int or leaf in seen:
            continue
        seen.add(leaf)
        text = record.get("value")
        if isinstance(text, str) and len(text) <= MAX_VALUE_CHARS:
            try:
                values[leaf] = ast.literal_eval(text)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
    return values if imported else None


def count_passed(plan: AssertPlan, values: Mapping[int, Any] | None) -> int:
    """How many of the plan's asserts hold for the decoded `values` (none without import)."""
    if values is None:
        return 0
    return sum(check.passes(values) for check in plan.checks)
