"""The reward of benchmarks/learn_real.py, in verl's shape: `compute_score(data_source,
solution_str, ground_truth, extra_info)` -> 1.0 when the response's final answer equals the
ground truth as a number, else 0.0.

The final answer is, in this order of preference:
1. the number inside the last \\boxed{...} ("\\boxed{7}", "$\\boxed{7}$", "\\boxed{7 \\text{ apples}}");
2. else the first number after the last "answer is" / "answer:" ("The answer is 7 apples.");
3. else the last number of the response ("3 + 4 = 7.", "She has 7 apples").
A number may carry a sign, thousands commas and decimals ("1,000", "7.0" equal 1000 and 7).
A response with no number scores 0.0, as does anything that is not a string; a ground truth
that is not a number raises ValueError (the data row is broken, not the model wrong).
Pure Python and fast: no timeouts needed.
"""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")   # one level of nested braces
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)", re.IGNORECASE)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def final_answer(response: str) -> float | None:
    """The response's final answer as a number (the rules of the module docstring), or None."""
    boxed = _BOXED.findall(response)
    if boxed:
        found = _NUMBER.findall(boxed[-1])
        return _number(found[0]) if found else None
    cues = list(_ANSWER_IS.finditer(response))
    if cues:
        found = _NUMBER.search(response, cues[-1].end())
        if found:
            return _number(found.group())
    found = _NUMBER.findall(response)
    return _number(found[-1]) if found else None


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    """1.0 when the final answer of `solution_str` equals `ground_truth`, else 0.0."""
    gold = _number(str(ground_truth).strip())
    if gold is None:
        raise ValueError(f"ground truth {ground_truth!r} ({data_source}) is not a number")
    if not isinstance(solution_str, str):
        return 0.0
    answer = final_answer(solution_str)
    return float(answer is not None and abs(answer - gold) < 1e-6)
