"""A small recursive-descent parser for countdown answers, over exact Fractions.

Grammar (whitespace between tokens is ignored):

    expr   := term   (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := NUMBER | "(" expr ")"
    NUMBER := digit+            (at most MAX_DIGITS digits)

There is no unary minus, no power, no names and no other characters: "2**3" and "9**9**9" fail
at the second "*". Nesting deeper than MAX_DEPTH fails instead of exhausting the Python stack.
With only + - * / over a handful of small literals the values stay small, so evaluation is
cheap whatever the model writes.
"""
from __future__ import annotations

from fractions import Fraction

MAX_DEPTH = 64
MAX_DIGITS = 18


class _Malformed(Exception):
    """The text is not in the grammar, or divides by zero."""


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in "+-*/()":
            tokens.append(ch)
            i += 1
        elif "0" <= ch <= "9":  # ASCII digits only: str.isdigit() accepts "²" and friends
            j = i
            while j < len(text) and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_DIGITS:
                raise _Malformed(f"number literal longer than {MAX_DIGITS} digits")
            tokens.append(text[i:j])
            i = j
        else:
            raise _Malformed(f"unexpected character {ch!r} at {i}")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.used: list[int] = []  # number literals in order of appearance

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise _Malformed("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term(depth)
            value = value + right if op == "+" else value - right
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.factor(depth)
            if op == "*":
                value = value * right
            elif right == 0:
                raise _Malformed("division by zero")
            else:
                value = value / right
        return value

    def factor(self, depth: int) -> Fraction:
        token = self.take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise _Malformed(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise _Malformed("expected ')'")
            return value
        if token.isdigit():
            self.used.append(int(token))
            return Fraction(int(token))
        raise _Malformed(f"unexpected token {token!r}")


def countdown_value(text: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, number literals used) of a countdown expression; None when malformed."""
    try:
        parser = _Parser(_tokenize(text))
        value = parser.expr(0)
        if parser.peek() is not None:
            raise _Malformed(f"unexpected token {parser.peek()!r} after the expression")
    except _Malformed:
        return None
    return value, parser.used
