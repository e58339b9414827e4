"""``calculator``: arithmetic evaluated safely on the host (no sandbox needed)."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from envs.tools.core import ActionError, ToolGroup, ToolOutput, tool

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_FUNCS: dict[str, Callable[..., Any]] = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "abs": abs,
                                         "factorial": math.factorial, "round": round, "sin": math.sin,
                                         "cos": math.cos, "tan": math.tan, "log10": math.log10, "log2": math.log2}
_CONSTS = {"pi": math.pi, "e": math.e}


def calculate(expression: str) -> int | float:
    """Evaluate arithmetic safely (no names but a few math functions; bounded powers)."""
    if len(expression) > 500:
        raise ActionError("calculator: expression too long (500 characters at most)")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ActionError(f"calculator: not an expression ({e.msg})") from None

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 10_000 or (abs(a) > 1 and abs(b) * math.log2(abs(a)) > 100_000)):
                raise ActionError("calculator: power too large")
            return _BINOPS[type(node.op)](a, b)
        if isinstance(node, ast.Name) and node.id in _CONSTS:
            return _CONSTS[node.id]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                and not node.keywords):
            args = [ev(a) for a in node.args]
            if node.func.id == "factorial" and (not args or args[0] > 5000):
                raise ActionError("calculator: factorial argument too large")
            return _FUNCS[node.func.id](*args)
        raise ActionError(f"calculator: unsupported element {ast.dump(node)[:60]}")

    try:
        value = ev(tree)
    except ActionError:
        raise
    except (ArithmeticError, ValueError, TypeError) as e:
        raise ActionError(f"calculator: {type(e).__name__}: {e}") from None
    if not isinstance(value, int | float):
        raise ActionError("calculator: the result is not a number")
    return value


class CalculatorTool(ToolGroup):
    """``calculator``: ``calculate`` as a tool."""

    @tool("Evaluate an arithmetic expression: + - * / // % ** ( ), sqrt, log, exp, factorial, pi, e.",
          {"expression": {"type": "string"}}, ["expression"])
    def calculator(self, expression: str) -> ToolOutput:
        v = calculate(expression)
        return ToolOutput(repr(v) if isinstance(v, float) else str(v))
