"""The built-in `calculator` tool: safe arithmetic on an expression.

The expression is parsed with Python's `ast` and evaluated by walking a whitelist of
nodes — numbers, `+ - * / // % **`, unary signs and parentheses — never `eval`. Names,
calls, attributes, subscripts and everything else are refused with a message naming
the offending piece. Exponents and results are bounded, so `9**9**9` is refused instead
of running until the sandbox's time limit.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, ClassVar

from peerflow.agents.tools import Tool

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
          ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
#: Largest magnitude of an exponent and of any intermediate result.
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 10**100
MAX_LENGTH = 500


def _check(value: float) -> float:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"the result is too large (more than 1e{len(str(MAX_MAGNITUDE)) - 1})")
    return value


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is too large (at most {MAX_EXPONENT})")
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and abs(right) * math.log10(
                abs(left)) > len(str(MAX_MAGNITUDE)):
            raise ValueError("the result is too large")
        try:
            return _check(BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    piece = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
    raise ValueError(f"{piece!r} is not arithmetic; use numbers, + - * / // % ** and "
                     "parentheses")


def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression and returns the result as text.

    Integers stay exact; other results are printed with 12 significant digits.

    Raises:
        ValueError: the expression is not arithmetic, divides by zero, or is too large.
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class Calculator(Tool):
    """Evaluates arithmetic expressions (`+ - * / // % **`, parentheses)."""

    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = (
        "Evaluates an arithmetic expression with + - * / // % ** and parentheses and "
        "returns the result.")
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {
            "type": "string", "description": "The expression, e.g. \"(12 + 7) * 3\"."}},
        "required": ["expression"],
    }

    def call(self, arguments: dict[str, Any]) -> str:
        """Returns `calculate(arguments["expression"])`."""
        return calculate(arguments["expression"])
