"""Assert-style tests judged on the host: the program only answers, it never grades itself.

A test string such as `assert fib(10) == 55` used to run as `program + tests` and pass on
exit status 0, so `raise SystemExit(0)`, `os._exit(0)`, an object whose `__eq__` is always
true, or a program that read the asserts from its own file scored 1. Now:

* `parse_asserts` splits the tests with `ast` on the host. Every `assert` (top level, or
  in a `def check(candidate)` the tests call as `check(fib)`: HumanEval's form) becomes a
  `Check`: a tree the host evaluates itself (`peerflow.rewards.assert_checks`:
  comparisons, `==` and `!=` by type and value so `55`, `55.0` and `True` differ;
  `and`/`or`/`not`, arithmetic, subscripts, displays, a few pure builtins) whose leaves
  are literals (`ast.literal_eval`, kept on the host: an expected value never enters the
  sandbox) or expressions the program must evaluate (`fib(10)`). Other statements
  (imports, helper definitions) run in the program's namespace, in order.
* `HARNESS`, a constant program, runs in the sandbox after the candidate (a string
  literal) and the plan's steps (setup statements and leaf expressions; no expected
  value). It reads a per-call random sentinel from stdin, points stdin and stdout at
  `/dev/null`, imports the program as the module `solution` in a namespace of its own
  (its `if __name__ == "__main__":` block does not run; any `BaseException`,
  `SystemExit` included, fails every test), evaluates each leaf, and prints one
  `<sentinel> (kind, leaf, text)` line per leaf with `repr()` of its value. A leaf that
  raises fails alone; past the harness's deadline (just inside the sandbox's time limit)
  the leaf running and every later one fail.
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
from collections.abc import Mapping
from typing import Any

import attrs

from peerflow.rewards.assert_checks import Check, CheckBuilder, decode
from peerflow.sandbox.result_channel import PRIVATE_STDOUT

#: Longest `repr()` of one value the host decodes.
MAX_VALUE_CHARS = 200_000
#: The sandboxed program (`harness_program` puts the candidate before it as `PROGRAM`).
HARNESS = r'''
import os, sys, time, _signal
SENTINEL = sys.stdin.read().strip()
deadline = time.monotonic() + SECONDS
PRIVATE_STDOUT

def report(*record):
    out.write(SENTINEL + " " + repr(record) + "\n")
    out.flush()

class Late(BaseException):
    pass

def late(signum, frame):
    raise Late()

def bounded(fn):
    left = deadline - time.monotonic()
    if left <= 0:
        raise Late()
    _signal.signal(_signal.SIGALRM, late)
    _signal.setitimer(_signal.ITIMER_REAL, left)
    try:
        return fn()
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)

def plain(value):  # Counter, defaultdict, a namedtuple: the plain container of their items
    for base in (dict, list, tuple, frozenset, set):
        if isinstance(value, base):
            if base is dict:
                return {plain(k): plain(v) for k, v in dict.items(value)}
            return base(plain(v) for v in base.__iter__(value))
    return value

def name(exc):
    try:
        return str(type(exc).__name__)[:100]
    except BaseException:
        return "error"

solution = type(sys)("solution")
solution.__file__ = "solution.py"
sys.modules["solution"] = solution
try:
    bounded(lambda: exec(compile(PROGRAM, "solution.py", "exec"), solution.__dict__))
    report("import", True)
except BaseException as exc:
    report("import", False, name(exc))
    out.close()
    os._exit(0)
leaf = 0
for kind, source in STEPS:
    try:
        if kind == "exec":
            bounded(lambda: exec(compile(source, "<tests>", "exec"), solution.__dict__))
            continue
        value = bounded(lambda: eval(compile(source, "<tests>", "eval"), solution.__dict__))
        report("value", leaf, bounded(lambda: repr(plain(value)))[:MAX + 1])
    except BaseException as exc:
        if kind == "eval":
            report("error", leaf, name(exc))
    leaf += kind == "eval"
out.close()
os._exit(0)
'''.replace("PRIVATE_STDOUT\n", PRIVATE_STDOUT.lstrip("\n"))


@attrs.frozen
class AssertPlan:
    """The tests split for the harness (`steps`) and for the host (`checks`)."""

    steps: tuple[tuple[str, str], ...]
    """`("exec", statement)` or `("eval", leaf expression)`, in the tests' order."""
    checks: tuple[Check, ...]


class _Substitute(ast.NodeTransformer):
    """Replaces a function's parameters by the call's argument expressions."""

    def __init__(self, names: Mapping[str, ast.expr]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.expr:  # noqa: N802 - ast's visitor name
        return self.names.get(node.id, node) if isinstance(node.ctx, ast.Load) else node


def _inlined(statement: ast.stmt, checks: Mapping[str, ast.FunctionDef]) -> list[ast.stmt]:
    """`check(fib)` (HumanEval's form) as the body of `check`, `candidate` read as `fib`."""
    call = statement.value if isinstance(statement, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id in checks and not call.keywords):
        return [statement]
    fn = checks[call.func.id]
    params = [a.arg for a in fn.args.args]
    if len(params) != len(call.args) or fn.args.vararg or fn.args.kwonlyargs:
        return [statement]
    names = dict(zip(params, call.args))
    return [_Substitute(names).visit(ast.fix_missing_locations(s)) for s in fn.body]


def _nested_assert(statement: ast.stmt) -> bool:
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    return any(isinstance(n, ast.Assert) for n in ast.walk(statement))


def parse_asserts(tests: str) -> AssertPlan:
    """Splits a string of Python tests into harness steps and host checks.

    Top-level asserts are checks; so are those of a function the tests define and call
    at top level with positional arguments (`def check(candidate): assert ...` then
    `check(fib)`, HumanEval's form), whose definition is never a step (it holds the
    expected values). Everything else is a step run in the program's namespace.

    Raises:
        ValueError: when the tests are not valid Python, hold no `assert`, or hold one
            inside a loop or another block (which the host cannot judge).
    """
    try:
        module = ast.parse(tests)
    except SyntaxError as exc:
        raise ValueError(f"the example's assert tests are not valid Python ({exc}); fix the "
                         "`tests` column") from exc
    defined = {s.name: s for s in module.body if isinstance(s, ast.FunctionDef)
               and any(isinstance(n, ast.Assert) for n in s.body)}
    steps: list[tuple[str, str]] = []
    checks: list[Check] = []
    builder = CheckBuilder(steps, 0)
    for statement in (s for top in module.body for s in _inlined(top, defined)):
        if isinstance(statement, ast.FunctionDef) and defined.get(statement.name) is statement:
            continue  # inlined where it is called; its source holds the expected values
        if isinstance(statement, ast.Assert):
            checks.append(Check(source=ast.unparse(statement),
                                tree=builder.build(statement.test)))
        elif _nested_assert(statement):
            raise ValueError(
                f"an assert inside a block ({ast.unparse(statement)[:80]!r}) cannot be judged "
                "on the host: write each case as a top-level `assert f(x) == expected` "
                "(or in a `def check(candidate)` called as `check(f)`)")
        else:
            steps.append(("exec", ast.unparse(statement)))
    if not checks:
        raise ValueError("the example's tests hold no `assert` statement; write tests as "
                         "`assert f(x) == expected` lines or [{input, output}, ...] pairs")
    return AssertPlan(steps=tuple(steps), checks=tuple(checks))


def harness_program(program: str, plan: AssertPlan, seconds: float) -> str:
    """The sandboxed program: `HARNESS` after the program, the steps and the deadline.

    The candidate `program` is a string literal, the plan's steps hold no expected value,
    `seconds` is the harness's own deadline. Its stdin is the call's sentinel alone.
    Everything is a Python literal, so the harness imports only built-in modules (`json`
    and `re` would cost ~20 ms a program).
    """
    steps = [list(step) for step in plan.steps]
    return (f"PROGRAM = {program!r}\nSTEPS = {steps!r}\nSECONDS = {float(seconds)!r}\n"
            f"MAX = {MAX_VALUE_CHARS}\n" + HARNESS)


def _record(text: str) -> tuple[Any, ...] | None:
    """A harness record: a flat tuple of constants, or `None` (never builds a container).

    The program can print lines that start with the sentinel: `ast.literal_eval` of one
    would build whatever it holds, and a set or dict of ints that share one hash costs
    the host quadratic time (33,000 of them: seconds).
    """
    try:
        node = ast.parse(text, mode="eval").body
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(node, ast.Tuple) or not all(isinstance(e, ast.Constant)
                                                  for e in node.elts):
        return None
    return tuple(e.value for e in node.elts)  # type: ignore[attr-defined]


def read_values(stdout: str, sentinel: str,
                leaves: int | None = None) -> dict[int, Any] | None:
    """The decoded leaf values in the harness's lines; `None` when the program did not import.

    Only lines `<sentinel> (kind, ...)` count, the first one for each leaf (of the first
    `leaves` when given: no other line is decoded); values are decoded by `decode`
    (plain data only; anything else is left out).
    """
    imported, values, seen = False, {}, set()
    head = sentinel + " "
    for line in stdout.splitlines():
        if not line.startswith(head) or len(line) > 4 * MAX_VALUE_CHARS + 200:
            continue
        record = _record(line[len(head):])
        if record is None or len(record) < 2:
            continue
        if record[:2] == ("import", True):
            imported = True
        if len(record) != 3 or record[0] not in ("value", "error") or type(
                record[1]) is not int or record[1] in seen or not (
                leaves is None or 0 <= record[1] < leaves):
            continue
        seen.add(record[1])
        text = record[2]
        if record[0] == "value" and isinstance(text, str) and len(text) <= MAX_VALUE_CHARS:
            try:
                values[record[1]] = decode(text)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
    return values if imported else None


def leaf_count(plan: AssertPlan) -> int:
    """How many leaf values the harness reports for `plan`."""
    return sum(kind == "eval" for kind, _ in plan.steps)


def count_passed(plan: AssertPlan, values: Mapping[int, Any] | None) -> int:
    """How many of the plan's asserts hold for the decoded `values` (none without import)."""
    if values is None:
        return 0
    return sum(check.passes(values) for check in plan.checks)
