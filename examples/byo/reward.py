"""The bring-your-own example's reward, in verl's shape: `compute_score(data_source,
solution_str, ground_truth, extra_info)` -> 1.0 when the response's final answer equals the
ground truth, else 0.0.

The final answer is the text after the last "####" of the response (GSM8K's marker), or the
whole response when it has none; it is cut at the first "<eos>" (the embedded model's stop token,
should the caller pass it through). math-verify then extracts the last math expression of that
text (a plain number such as "42" or "1,000", or LaTeX such as "\\boxed{42}" or "$42$") and
compares it with the ground truth as math, so "7", "7.0" and "\\frac{14}{2}" all equal 7.
A response with no extractable answer scores 0.0; a ground truth that math-verify cannot parse
raises (the data row is broken, not the model wrong).

math-verify's own timeouts use signal.alarm, which works only in a process's main thread; they
are off here, so the caller must bound the time (sealrl's reward pool does: reward.num_scorers
> 0 and reward.timeout_s).
"""
from __future__ import annotations

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

EOS_TEXT = "<eos>"
MARKER = "####"
_EXTRACT = [ExprExtractionConfig(), LatexExtractionConfig()]


def _parse(text: str) -> list:
    # no_fallback: text that is not math yields nothing, never its raw string
    return parse(text, _EXTRACT, fallback_mode="no_fallback", parsing_timeout=None)


def final_answer_text(solution_str: str) -> str:
    """The part of the response that holds its final answer (see the module docstring)."""
    text = solution_str.split(EOS_TEXT, 1)[0]
    return text.rsplit(MARKER, 1)[1] if MARKER in text else text


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    """1.0 when the final answer of `solution_str` equals `ground_truth` as math, else 0.0."""
    gold = _parse(str(ground_truth).replace(",", ""))
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r} ({data_source})")
    answer = _parse(final_answer_text(solution_str))
    if not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=None))
