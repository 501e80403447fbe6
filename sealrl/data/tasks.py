"""Synthetic verifiable tasks as rows in the verl dataset layout.

A row is a plain dict, ready for `write_jsonl` / `write_parquet` or `prompts_from_rows`:

    {"id": "arith-5c0f...", "prompt": [{"role": "user", "content": "07+45="}],
     "data_source": "arith", "reward_model": {"ground_truth": "250", "style": "rule"},
     "extra_info": {"index": 0, "split": "train", ...}}

Held-out problems never leak into training: whether a problem is `train` or `test` is decided
by a hash of its canonical form (operands and operators, or numbers and target), not by the
seed or the number of rows asked for. Any two calls, whatever their seeds, therefore give
disjoint train and test sets, and the test set of a given (num, seed) is the same forever.

Randomness comes from `random.Random(<string seed>).random()` only: Python guarantees that
stream across versions (unlike `randint`/`shuffle`), so golden rows stay golden.
"""
from __future__ import annotations

import difflib
import hashlib
import inspect
import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable

SPLITS = ("train", "test")


def _rand_int(rng: random.Random, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi] built on `random()`, the one stream Python keeps stable."""
    return lo + int(rng.random() * (hi - lo + 1))


def split_of(task: str, canonical: str, test_fraction: float) -> str:
    """`test` for a stable `test_fraction` of all problems, decided by hashing the problem."""
    h = int.from_bytes(hashlib.sha256(f"{task}|{canonical}".encode()).digest()[:8], "big")
    return "test" if h % 1_000_000 < round(test_fraction * 1_000_000) else "train"


def _row(task: str, index: int, split: str, content: str, ground_truth: Any,
         canonical: str, opts: dict, extra: dict) -> dict:
    # The id hashes the problem *and* its format options: the same sum written reversed or
    # not has a different ground truth, so it must not share an id.
    key = repr((task, canonical, sorted(opts.items())))
    row_id = f"{task}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return {
        "id": row_id,
        "prompt": [{"role": "user", "content": content}],
        "data_source": task,
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {"index": index, "split": split, "problem": canonical, **extra},
    }


def _distinct(task: str, split: str, num: int, seed: int, test_fraction: float,
              draw: Callable[[random.Random], tuple[str, Any]]) -> list[tuple[str, Any]]:
    """`num` distinct problems of `split`, by rejection sampling: draw, hash, keep or reject.

    Rejection keeps the split a pure function of the problem (see module docstring); the
    attempt cap turns "asked for more problems than the split holds" into an error.
    """
    rng = random.Random(f"sealrl-task:{task}:{split}:{seed}")
    seen: set[str] = set()
    out: list[tuple[str, Any]] = []
    for _ in range(1000 + 200 * num):
        if len(out) == num:
            return out
        canonical, problem = draw(rng)
        if canonical in seen or split_of(task, canonical, test_fraction) != split:
            continue
        seen.add(canonical)
        out.append((canonical, problem))
    if len(out) == num:
        return out
    raise ValueError(f"{task}: could only find {len(out)} distinct {split} problems, asked for "
                     f"num={num}; the split is too small for these options")


# ----------------------------------------------------------------------------- arithmetic

def _evaluate(operands: list[int], operators: list[str]) -> int:
    """Standard precedence: fold '*' into terms, then add/subtract the terms left to right."""
    terms, signs = [operands[0]], [1]
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def arith_rows(split: str, num: int, seed: int, digits: int = 2, ops: str = "+",
               num_operands: int = 2, pad_operands: bool = True, reverse_answer: bool = True,
               pad_answer: bool = True, test_fraction: float = 0.1) -> list[dict]:
    """`a+b=` problems; the ground truth is the exact response string (before <eos>).

    Operands are uniform in [0, 10**digits - 1], operators drawn from `ops` (standard
    precedence). The answer is zero-padded to the widest possible result when `pad_answer`
    (so every response has the same length and the model never has to decide when to stop),
    then its digits reversed when `reverse_answer` (least significant digit first, the order
    in which carries are computed). A negative answer keeps its '-' in front.

    Default (the embedded task): "07+45=" -> "250" (52 -> "052" -> reversed "250").
    """
    if digits < 1 or num_operands < 2 or not ops or set(ops) - set("+-*"):
        raise ValueError(f"arith: need digits >= 1, num_operands >= 2 and ops from '+-*', got "
                         f"digits={digits}, num_operands={num_operands}, ops={ops!r}")
    top = 10 ** digits - 1
    # Largest |result|: a full product when '*' is allowed, else a full sum.
    bound = top ** num_operands if "*" in ops else top * num_operands
    width = len(str(bound))

    def draw(rng: random.Random) -> tuple[str, Any]:
        operands = [_rand_int(rng, 0, top) for _ in range(num_operands)]
        operators = [ops[_rand_int(rng, 0, len(ops) - 1)] for _ in range(num_operands - 1)]
        canonical = str(operands[0]) + "".join(o + str(x) for o, x in zip(operators, operands[1:]))
        return canonical, (operands, operators)

    opts = dict(digits=digits, ops=ops, num_operands=num_operands, pad_operands=pad_operands,
                reverse_answer=reverse_answer, pad_answer=pad_answer)
    rows = []
    for i, (canonical, (operands, operators)) in enumerate(
            _distinct("arith", split, num, seed, test_fraction, draw)):
        value = _evaluate(operands, operators)
        fmt = (lambda x: str(x).zfill(digits)) if pad_operands else str
        content = fmt(operands[0]) + "".join(o + fmt(x) for o, x in zip(operators, operands[1:]))
        answer = str(abs(value)).zfill(width) if pad_answer else str(abs(value))
        answer = ("-" if value < 0 else "") + (answer[::-1] if reverse_answer else answer)
        rows.append(_row("arith", i, split, content + "=", answer, canonical, opts,
                         {"answer": value}))
    return rows


# ----------------------------------------------------------------------------- countdown

def _random_expression(rng: random.Random, numbers: list[int], ops: str) -> tuple[str, Fraction]:
    """Combine all `numbers` (in the given order) with a random binary tree of `ops`.

    Returns the expression text (every inner node parenthesised, the root not) and its value.
    """
    items: list[tuple[str, Fraction]] = [(str(n), Fraction(n)) for n in numbers]
    while len(items) > 1:
        j = _rand_int(rng, 0, len(items) - 2)
        (ta, va), (tb, vb) = items[j], items[j + 1]
        op = ops[_rand_int(rng, 0, len(ops) - 1)]
        if op == "/" and vb == 0:
            op = "+"
        value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb if vb else va}[op]
        wrap = lambda t: t if t.isdigit() else f"({t})"
        items[j:j + 2] = [(f"{wrap(ta)}{op}{wrap(tb)}", value)]
    return items[0]


def countdown_rows(split: str, num: int, seed: int, min_numbers: int = 3, max_numbers: int = 4,
                   max_number: int = 20, max_target: int = 100, ops: str = "+-*",
                   test_fraction: float = 0.1) -> list[dict]:
    """Reach a target with each given number used exactly once: "use 3,5,2 to make 16:".

    The target is the value of a random expression over *all* the numbers (so it is reachable
    with every number used once), kept when it is an integer in [1, max_target]. Ground truth
    is {"target", "numbers"}; the response is an expression such as "(3+5)*2" that a verifier
    evaluates. The generating expression is in extra_info["solution"] (one of possibly many).
    """
    if not 2 <= min_numbers <= max_numbers or max_number < 1 or set(ops) - set("+-*/") or not ops:
        raise ValueError(f"countdown: need 2 <= min_numbers <= max_numbers, max_number >= 1 "
                         f"and ops from '+-*/', got min_numbers={min_numbers}, max_numbers="
                         f"{max_numbers}, max_number={max_number}, ops={ops!r}")

    def draw(rng: random.Random) -> tuple[str, Any]:
        while True:
            k = _rand_int(rng, min_numbers, max_numbers)
            numbers = [_rand_int(rng, 1, max_number) for _ in range(k)]
            text, value = _random_expression(rng, numbers, ops)
            if value.denominator == 1 and 1 <= value <= max_target:
                break
        canonical = ",".join(map(str, sorted(numbers))) + f">{int(value)}"
        return canonical, (numbers, int(value), text)

    opts = dict(min_numbers=min_numbers, max_numbers=max_numbers, max_number=max_number,
                max_target=max_target, ops=ops)
    rows = []
    for i, (canonical, (numbers, target, text)) in enumerate(
            _distinct("countdown", split, num, seed, test_fraction, draw)):
        content = f"use {','.join(map(str, numbers))} to make {target}:"
        truth = {"target": target, "numbers": numbers}
        rows.append(_row("countdown", i, split, content, truth, canonical, opts, {"solution": text}))
    return rows


# ----------------------------------------------------------------------------- multi-turn tasks

def mul3_rows(split: str, num: int, seed: int, test_fraction: float = 0.1) -> list[dict]:
    """The tool task: 3-digit products, "123*456=" -> "56088" (plain digits, no padding),
    beyond the embedded model alone; with the calculator (env.name=calc) a policy that calls
    `<calc>123*456</calc>` and copies the answer solves it."""
    return arith_rows(split, num, seed, digits=3, ops="*", num_operands=2, pad_operands=True,
                      reverse_answer=False, pad_answer=False, test_fraction=test_fraction)


def guess_rows(split: str, num: int, seed: int, high: int = 99, test_fraction: float = 0.1) -> list[dict]:
    """The guessing game (env.name=guess): "guess 0-99:", the ground truth is the secret.
    Problems are (secret, round) pairs, so the splits hold many rows of the same 100 secrets."""
    def draw(rng: random.Random) -> tuple[str, Any]:
        secret, rnd = _rand_int(rng, 0, high), _rand_int(rng, 0, 999)
        return f"{secret}@{rnd}", secret

    return [_row("guess", i, split, f"guess 0-{high}:", str(secret), canonical, dict(high=high), {})
            for i, (canonical, secret) in enumerate(_distinct("guess", split, num, seed, test_fraction, draw))]


# ----------------------------------------------------------------------------- entry point

TASKS: dict[str, Callable[..., list[dict]]] = {"arith": arith_rows, "countdown": countdown_rows,
                                               "mul3": mul3_rows, "guess": guess_rows}


def make_task(name: str, split: str = "train", num: int = 1000, seed: int = 0, **opts) -> list[dict]:
    """`num` distinct problems of task `name` from `split`, deterministic in (split, num, seed,
    opts). Train and test are disjoint for every seed (see `split_of`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(num, int) or num < 0:
        raise ValueError(f"num must be a non-negative int, got {num!r}")
    fn = TASKS[name]
    known = list(inspect.signature(fn).parameters)[3:]
    for key in opts:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            raise ValueError(f"{name}: unknown option {key!r}"
                             + (f"; did you mean {hint[0]!r}?" if hint else f"; known: {known}"))
    return fn(split, num, seed, **opts)


@dataclass(frozen=True, slots=True)
class EmbeddedTask:
    """The task the embedded warm start and the RL demo share.

    The demo must evaluate on exactly `eval_rows()`: the warm-start accuracy recorded in
    sealrl/assets/arith-tiny/WARM_START.md was measured on these rows.
    """

    name: str = "arith"
    opts: dict = field(default_factory=lambda: dict(digits=2, ops="+", num_operands=2,
                                                    pad_operands=True, reverse_answer=True,
                                                    pad_answer=True, test_fraction=0.1))
    eval_num: int = 500
    """Held-out problems used for every reported accuracy."""
    eval_seed: int = 1234
    sft_num: int = 450
    """Supervised problems of the warm start: `train_rows(sft_num, sft_seed)`. Measured
    plateaus (held-out greedy accuracy, this model with its earlier 81-character vocabulary):
    300 -> 9%, 450 -> 29%, 600 -> 81%, 750 -> 100%; the shipped printable-ASCII warm start
    plateaus at 28.2% with 450 (sealrl/assets/arith-tiny/WARM_START.md)."""
    sft_seed: int = 0
    max_new_tokens: int = 5
    """Enough for the 3-digit answer, <eos>, and one token of slack to see a missed stop."""

    def eval_rows(self) -> list[dict]:
        return make_task(self.name, "test", self.eval_num, self.eval_seed, **self.opts)

    def train_rows(self, num: int, seed: int) -> list[dict]:
        return make_task(self.name, "train", num, seed, **self.opts)


EMBEDDED_TASK = EmbeddedTask()
