"""Built-in rule-based verifiers and their composition.

Every scorer here is a picklable module-level class, so it runs inline or in a RewardPool
worker (the learned reward model is in sealrl.rewards.reward_model). Model output is only ever
matched by regexes compiled from config, compared as a string, or read by the small countdown
parser in sealrl.rewards.countdown; nothing evaluates it with eval/exec. MathVerifier hands it to math-verify's
LaTeX extraction (an ANTLR grammar), never to its plain-expression extraction (that one calls
sympy.parse_expr, i.e. eval).

A verifier raises only when the *sample* is unusable (bad ground truth): that is a scorer
error. A wrong, malformed or empty answer is a valid 0.0.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from sealrl.rewards.base import RawScore, RewardFunction, RewardSample, call_checked
from sealrl.rewards.countdown import countdown_value

# math-verify warns "Timeout is disabled" once per process: its timeouts are off on purpose (see
# MathVerifier), so the line is noise a user cannot act on. Its other warnings report timeouts,
# which cannot fire with timeouts off. Set by name: math_verify need not be imported yet.
logging.getLogger("math_verify").setLevel(logging.ERROR)

DEFAULT_EOS_TEXT = "<eos>"  # the eos text of sealrl.models.tiny; decoders may leave it in


def answer_text(response: str, eos_text: str = DEFAULT_EOS_TEXT) -> str:
    """The response without surrounding whitespace and without one trailing eos text."""
    text = response.strip()
    if eos_text and text.endswith(eos_text):
        text = text[: -len(eos_text)].rstrip()
    return text


@dataclass(frozen=True)
class ArithmeticExactMatch:
    """1.0 when the answer text equals str(ground_truth) (both stripped), else 0.0."""

    eos_text: str = DEFAULT_EOS_TEXT
    name: str = "arithmetic_exact_match"
    version: str = "1"

    def __call__(self, sample: RewardSample) -> float:
        truth = sample.ground_truth
        if isinstance(truth, bool) or not isinstance(truth, (str, int)):
            raise ValueError(f"ground_truth must be a str or int, got {truth!r}")
        return float(answer_text(sample.response, self.eos_text) == str(truth).strip())


@dataclass(frozen=True)
class CountdownVerifier:
    """Countdown: reach `target` with `numbers`, each used EXACTLY once (as in TinyZero).

    ground_truth: {"target": int, "numbers": [int, ...]} (or that dict as a JSON string).
    The whole answer text must be an expression of non-negative integer literals, binary
    + - * /, and parentheses (grammar in sealrl.rewards.countdown; no unary minus, no powers),
    evaluated over exact Fractions. 1.0 when it parses, uses the multiset `numbers` exactly, and
    equals `target`; 0.0 otherwise (including malformed text and division by zero).
    """

    eos_text: str = DEFAULT_EOS_TEXT
    name: str = "countdown"
    version: str = "1"

    def __call__(self, sample: RewardSample) -> float:
        target, numbers = _countdown_truth(sample.ground_truth)
        result = countdown_value(answer_text(sample.response, self.eos_text))
        if result is None:
            return 0.0
        value, used = result
        return float(value == target and sorted(used) == sorted(numbers))


def _countdown_truth(truth: Any) -> tuple[int, list[int]]:
    if isinstance(truth, str):
        truth = json.loads(truth)  # dataset text, not model output
    if not isinstance(truth, dict):
        raise ValueError(f"countdown ground_truth must be a dict, got {truth!r}")
    target, numbers = truth.get("target"), truth.get("numbers")

    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(target) or not isinstance(numbers, (list, tuple)) or not numbers \
            or not all(is_int(n) and n >= 0 for n in numbers):
        raise ValueError("countdown ground_truth needs an int 'target' and a non-empty list of "
                         f"non-negative int 'numbers', got {truth!r}")
    return target, list(numbers)


@dataclass(frozen=True)
class MathVerifier:
    """1.0 when math-verify finds the response's LaTeX answer equal to the ground truth.

    The response answer is extracted with math_verify.LatexExtractionConfig only (\\boxed{...},
    $...$, \\[...\\]); a bare "42" without LaTeX is not extracted and scores 0.0. The ground truth
    is parsed the same way, wrapped in $...$ when it has no LaTeX delimiters; a ground truth that
    parses to nothing raises (the dataset row is unusable, not the model wrong). Only spans that
    parse to math count (fallback_mode="no_fallback"): no raw-string comparisons.

    math-verify's own timeouts use signal.alarm, which fails outside the main thread and would
    replace the pool's SIGALRM handling; they are switched off (parsing_timeout=None,
    timeout_seconds=None) and the pool deadline bounds the time instead. Inline use therefore
    has no time bound: sympy can take unbounded time on inputs like \\boxed{9^{9^{9}}}.
    math_verify (and sympy, ~0.3 s) is imported on first use, not when this module loads.
    """

    float_rounding: int = 6
    eos_text: str = DEFAULT_EOS_TEXT
    name: str = "math_verify"
    version: str = "1"

    def setup(self) -> None:
        import math_verify  # noqa: F401  (pay the import at worker start, not on the first sample)

    def __call__(self, sample: RewardSample) -> float:
        from math_verify import LatexExtractionConfig, parse, verify

        def parse_latex(text: str) -> list:
            # no_fallback: a LaTeX span that does not parse yields nothing, not its raw string
            return parse(text, [LatexExtractionConfig()], fallback_mode="no_fallback",
                         parsing_timeout=None)

        truth = sample.ground_truth
        if isinstance(truth, bool) or not isinstance(truth, (str, int)):
            raise ValueError(f"ground_truth must be a LaTeX str or an int, got {truth!r}")
        truth = str(truth).strip()
        gold = parse_latex(truth) or parse_latex(f"${truth}$")
        if not gold:
            raise ValueError(f"math-verify could not parse ground_truth {truth!r}")
        answer = parse_latex(answer_text(sample.response, self.eos_text))
        if not answer:
            return 0.0
        return float(verify(gold, answer, float_rounding=self.float_rounding,
                            timeout_seconds=None))


@dataclass(frozen=True)
class FormatReward:
    """1.0 when `pattern` fully matches the answer text (re.DOTALL: '.' spans lines), else 0.0.

    The pattern comes from config and is compiled once; the version carries its hash so two
    runs with different patterns never share a scorer version. A pathological pattern can
    backtrack for a long time: the pool deadline bounds it.
    """

    pattern: str
    eos_text: str = DEFAULT_EOS_TEXT
    name: str = "format"
    version: str = field(init=False)
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(self.pattern, re.DOTALL))
        digest = hashlib.sha256(self.pattern.encode()).hexdigest()[:8]
        object.__setattr__(self, "version", f"1-{digest}")

    def __call__(self, sample: RewardSample) -> float:
        return float(self._regex.fullmatch(answer_text(sample.response, self.eos_text)) is not None)


class WeightedReward:
    """total = sum_i w_i * c_i over named component scorers; components keep each raw c_i.

    A component that returns a dict contributes its "total" as c_i and its own components as
    "name/key". A component that raises, or returns something invalid, makes the whole sample an
    error: a partial sum is not a score. The version lists every component's name, version and
    weight, so changing any of them changes the composite's version.
    """

    def __init__(self, components: dict[str, tuple[RewardFunction, float]],
                 name: str = "weighted") -> None:
        if not components:
            raise ValueError("WeightedReward needs at least one component")
        for key, (_, weight) in components.items():
            if key == "total":
                raise ValueError("WeightedReward: 'total' is reserved, name the component otherwise")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                    or not math.isfinite(weight):
                raise ValueError(f"WeightedReward: weight of {key!r} must be a finite number, "
                                 f"got {weight!r}")
        self.components = dict(components)
        self.name = name
        self.version = ";".join(f"{key}={fn.name}@{fn.version}*{float(w)!r}"
                                for key, (fn, w) in self.components.items())

    def setup(self) -> None:
        for fn, _ in self.components.values():
            setup = getattr(fn, "setup", None)  # optional hook (RewardFunction docstring)
            if setup is not None:
                setup()

    def __call__(self, sample: RewardSample) -> RawScore:
        out: dict[str, float] = {}
        total = 0.0
        for key, (fn, weight) in self.components.items():
            value, parts = call_checked(fn, sample, f"component {key!r} ({fn.name})")
            out[key] = value
            out.update({f"{key}/{k}": v for k, v in parts.items()})
            total += weight * value
        out["total"] = total
        return out
