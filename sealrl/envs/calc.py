"""The calculator tool and the built-in tool environment of the embedded tool task.

`calculator("123*456")` -> "56088": integers, + - * / and parentheses, evaluated over exact
fractions by walking Python's parsed syntax tree (ast.parse never executes anything; any node
other than those operators and integer literals is refused). Division gives an integer when
exact, else "p/q"; leading zeros are read as decimal ("013" is 13). Expressions longer than
64 characters and results with more than 64 digits are refused, so a call cannot ask for
unbounded work.
"""
from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

from sealrl.envs.tools import ToolEnv

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        out = _OPS[type(node.op)](left, right)
        if abs(out.numerator) >= 10 ** 64 or out.denominator >= 10 ** 64:
            raise ValueError("result too large")
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError(f"not allowed in a calculation: {type(node).__name__}")


def calculator(expression: str) -> str:
    text = expression.strip()
    if not text or len(text) > 64:
        raise ValueError(f"expression of {len(text)} characters (1..64 allowed)")
    text = re.sub(r"(?<![\d.])0+(?=\d)", "", text)   # "013" is 13 (Python refuses leading zeros)
    value = _value(ast.parse(text, mode="eval").body)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


class CalcEnv(ToolEnv):
    """The `calc` environment: one tool, `<calc>expression</calc>`."""

    name = "calc"
    version = "1"

    def __init__(self, timeout_s: float = 2.0, max_output_chars: int = 64) -> None:
        super().__init__({"calc": calculator}, timeout_s, max_output_chars)
