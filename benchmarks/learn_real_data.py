"""The data set of benchmarks/learn_real.py: generated one- and two-step arithmetic word problems
in the verl layout, a fixed seed, disjoint training and held-out questions.

    .venv/bin/python benchmarks/learn_real_data.py --out examples/learn_real/data

Each row's prompt is a system message, one worked example (user + assistant turns) and the
question. Why the worked example: without it SmolLM2-135M-Instruct rarely states a final answer
that can be scored (benchmarks/smollm2_arith.py), and with no rewarded sample GRPO has no signal.
The answer is checked by benchmarks/learn_real_reward.py, which also reads the model's other
natural formats ("The answer is 7", "= 7.", "7 apples").

Problems (a, b, c small whole numbers, every answer a whole number >= 0):
one step   a + b, a - b, a x b, (a x b) / b
two steps  a + b - c ("has a, buys b, gives away c"), a - b + c, a x b + c, a x b - c
Sums and differences stay within 2-20 and products within 2-5 x 2-5. Why so small: with operands
up to 40 (sessions 11-17) the model's own arithmetic was most of its error (greedy 0.15 on the
held-out rows, 3% of samples right at temperature 1.0), and 40 GRPO steps moved it by +5 points;
with these it is 0.235 greedy, its samples are right often enough for most groups to carry a
signal, and what GRPO can teach in tens of steps (set up the right operation, state the answer)
is what it gets wrong (docs/benchmarks.md, "learn_real").
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

DATA_SOURCE = "learn_real_arith"
SYSTEM = "Solve the math word problem. Give the final answer as \\boxed{number}."
SHOT = [{"role": "user", "content": "Ann has 2 pens and buys 3 more. Then she gives 1 pen to Bo. "
                                    "How many pens does Ann have now?"},
        {"role": "assistant", "content": "2 + 3 = 5, and 5 - 1 = 4. The answer is \\boxed{4}."}]
NAMES = [("Tom", "he"), ("Sara", "she"), ("Ben", "he"), ("Mia", "she"), ("Leo", "he"), ("Lily", "she"),
         ("Max", "he"), ("Emma", "she"), ("Sam", "he"), ("Zoe", "she"), ("Jack", "he"), ("Nora", "she"),
         ("Omar", "he"), ("Ivy", "she"), ("Raj", "he"), ("Lena", "she")]
OBJECTS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "coins", "shells", "cards",
           "balloons", "stamps", "crayons", "oranges", "buttons", "toy cars", "beads"]
CONTAINERS = ["bags", "boxes", "packs", "jars", "baskets"]


def _one_step(rng: random.Random, name: str, he: str, obj: str, box: str) -> tuple[str, int]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"{name} has {a} {obj} and buys {b} more. How many {obj} does {he} have now?", a + b
    if kind == 1:
        a = rng.randint(5, 20)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {obj} and gave {b} of them away. How many {obj} are left?", a - b
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    if kind == 2:
        return f"{name} has {a} {box} with {b} {obj} in each. How many {obj} does {he} have?", a * b
    return f"{name} shares {a * b} {obj} equally among {b} friends. How many {obj} does each friend get?", a


def _two_step(rng: random.Random, name: str, he: str, obj: str, box: str) -> tuple[str, int]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        c = rng.randint(1, a + b - 1)
        return (f"{name} has {a} {obj}, buys {b} more, and then gives {c} to a friend. "
                f"How many {obj} does {he} have now?", a + b - c)
    if kind == 1:
        a = rng.randint(5, 20)
        b, c = rng.randint(1, a - 1), rng.randint(2, 10)
        return (f"{name} had {a} {obj}, lost {b}, and then found {c}. "
                f"How many {obj} does {he} have now?", a - b + c)
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    if kind == 2:
        c = rng.randint(1, 10)
        return (f"{name} buys {a} {box} of {obj} with {b} in each, and {c} more loose. "
                f"How many {obj} does {he} have?", a * b + c)
    c = rng.randint(1, a * b - 1)
    return (f"{name} has {a} {box} with {b} {obj} in each and gives away {c} {obj}. "
            f"How many {obj} are left?", a * b - c)


def problem(rng: random.Random) -> tuple[str, int, int]:
    """One (question, answer, number of steps), half of them two-step."""
    name, he = rng.choice(NAMES)
    obj, box = rng.choice(OBJECTS), rng.choice(CONTAINERS)
    steps = rng.choice((1, 2))
    make = _one_step if steps == 1 else _two_step
    return (*make(rng, name, he, obj, box), steps)


def split(num_train: int, num_test: int, seed: int = 0) -> tuple[list, list]:
    """Distinct problems from one seeded stream: the first num_test held out, the next num_train
    for training, so no question is in both."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < num_test + num_train:
        q, a, steps = problem(rng)
        if q not in seen:
            seen.add(q)
            out.append((q, a, steps))
        if len(seen) > 50 * (num_train + num_test):
            raise RuntimeError("too few distinct problems for the requested sizes")
    return out[num_test:], out[:num_test]


def rows(problems: list, split_name: str) -> list[dict]:
    """verl layout: data_source, prompt (chat messages), reward_model.ground_truth, extra_info."""
    return [{"data_source": DATA_SOURCE,
             "prompt": [{"role": "system", "content": SYSTEM}, *SHOT, {"role": "user", "content": q}],
             "reward_model": {"style": "rule", "ground_truth": str(a)},
             "extra_info": {"split": split_name, "index": i, "steps": steps}}
            for i, (q, a, steps) in enumerate(problems)]


def write(out: Path, num_train: int = 500, num_test: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """train.parquet and test.parquet under `out`; returns their paths."""
    from sealrl.data.dataset import write_parquet
    train, test = split(num_train, num_test, seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "test.parquet"
    write_parquet(rows(train, "train"), paths[0])
    write_parquet(rows(test, "test"), paths[1])
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for train.parquet and test.parquet")
    ap.add_argument("--num-train", type=int, default=500)
    ap.add_argument("--num-test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    train, test = write(a.out, a.num_train, a.num_test, a.seed)
    print(f"wrote {train} ({a.num_train} rows) and {test} ({a.num_test} rows)")


if __name__ == "__main__":
    main()
