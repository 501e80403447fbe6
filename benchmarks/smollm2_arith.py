"""The small verl-layout data set of the SmolLM2 measurement in docs/benchmarks.md: 16 training
and 8 held-out one-step arithmetic word problems, each prompt a system message, one worked
example (user + assistant turns, answer in \\boxed{}) and the question.

    .venv/bin/python benchmarks/smollm2_arith.py --out /tmp/smollm2-arith
    .venv/bin/sealrl train examples/smollm2_byo.yaml data.train_file=/tmp/smollm2-arith/train.parquet \\
        data.eval_file=/tmp/smollm2-arith/test.parquet run.iterations=4 reward.fn=math

Why the worked example: SmolLM2-135M-Instruct answers "The answer is: 7", which the built-in
reward.fn=math (math-verify on LaTeX only) scores 0; with no rewarded sample GRPO has no
signal. One example turn in the prompt makes it write $\\boxed{7}$ often enough to learn from.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from sealrl.data.dataset import write_parquet

SYSTEM = "Solve the math problem. Give the final answer as \\boxed{number}."
SHOT = [{"role": "user", "content": "Ann has 2 pens and buys 3 more. How many pens does she have?"},
        {"role": "assistant", "content": "2 + 3 = 5. The answer is $\\boxed{5}$."}]
TRAIN = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", 7),
    ("A box holds 5 pens. How many pens are in 2 boxes?", 10),
    ("Sara had 9 stickers and gave away 3. How many are left?", 6),
    ("There are 8 birds on a tree and 2 fly away. How many birds remain?", 6),
    ("Ben reads 6 pages a day. How many pages does he read in 3 days?", 18),
    ("A class has 12 girls and 10 boys. How many children are in the class?", 22),
    ("Lily has 20 cents and spends 5 cents. How much money is left?", 15),
    ("Each car has 4 wheels. How many wheels do 3 cars have?", 12),
    ("Max had 14 marbles and lost 4. How many marbles does he have now?", 10),
    ("A baker makes 7 cakes in the morning and 5 in the afternoon. How many cakes in total?", 12),
    ("There are 16 cookies shared equally by 4 kids. How many cookies does each kid get?", 4),
    ("Anna is 9 years old. How old will she be in 6 years?", 15),
    ("A farmer has 11 cows and buys 9 more. How many cows does he have?", 20),
    ("A bag has 30 candies. 10 are eaten. How many candies remain?", 20),
    ("Sam runs 2 miles each day for 5 days. How many miles does he run?", 10),
    ("A shelf has 3 rows of 6 books. How many books are on the shelf?", 18),
]
TEST = [
    ("Mia has 5 dolls and gets 3 more. How many dolls does she have?", 8),
    ("A pack has 6 juice boxes. How many juice boxes are in 2 packs?", 12),
    ("Joe had 15 balloons and 5 popped. How many balloons are left?", 10),
    ("There are 7 ducks and 6 geese in a pond. How many birds are there?", 13),
    ("A pizza has 8 slices. How many slices are in 3 pizzas?", 24),
    ("Kim had 25 dollars and spent 10. How many dollars does she have?", 15),
    ("Each spider has 8 legs. How many legs do 2 spiders have?", 16),
    ("A tank has 18 fish and 9 are moved out. How many fish stay?", 9),
]


def rows(problems: list[tuple[str, int]], split: str) -> list[dict]:
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "system", "content": SYSTEM}, *SHOT, {"role": "user", "content": q}],
             "reward_model": {"style": "rule", "ground_truth": str(a)},
             "extra_info": {"split": split, "index": i}} for i, (q, a) in enumerate(problems)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for train.parquet and test.parquet")
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    write_parquet(rows(TRAIN, "train"), out / "train.parquet")
    write_parquet(rows(TEST, "test"), out / "test.parquet")
    print(f"wrote {out}/train.parquet ({len(TRAIN)} rows) and {out}/test.parquet ({len(TEST)} rows)")


if __name__ == "__main__":
    main()
