"""GSM8K-layout JSONL -> verl-layout Parquet: a fixed, seeded train/test split.

    python examples/byo/convert.py [--src examples/byo/problems.jsonl] [--out-dir examples/byo/data]

Input: one JSON object per line, {"question": str, "answer": "...reasoning...\\n#### 42"} (the
GSM8K layout). Output: `train.parquet` and `test.parquet` in the verl layout that sealrl's
dataset loader reads (sealrl/data/dataset.py), one row per problem:

    data_source   "byo_word_problems"
    prompt        [{"role": "user", "content": <question> + INSTRUCTION}]
    reward_model  {"style": "rule", "ground_truth": <the text after the last "####", commas removed>}
    extra_info    {"split", "index" (the problem's line number - 1; its prompt id), "question", "answer"}

The split is a shuffle of the problems with random.Random(seed), the first --test-size of them
held out; the same file and seed give the same split on every machine. A line that is not such
an object is an error naming the file and line, and nothing is written.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
DATA_SOURCE = "byo_word_problems"
# Short on purpose: the embedded model has 128 positions for prompt and response together.
INSTRUCTION = "\nAnswer after ####."


class ConvertError(ValueError):
    """A problem line that cannot be converted; the message names file, line and field."""


def final_answer(answer: str, where: str) -> str:
    """The GSM8K final answer: the text after the last '####', thousands commas removed."""
    if "####" not in answer:
        raise ConvertError(f"{where}: field 'answer': has no '#### <final answer>'; got {answer[-60:]!r}")
    truth = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not truth:
        raise ConvertError(f"{where}: field 'answer': nothing after the last '####'")
    return truth


def read_problems(src: Path) -> list[dict]:
    """The problems in file order, each checked; blank lines are skipped."""
    problems = []
    for n, line in enumerate(src.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{src}: line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConvertError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ConvertError(f"{where}: a line must be a JSON object; got {type(obj).__name__}")
        for key in ("question", "answer"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise ConvertError(f"{where}: field {key!r}: must be a non-empty string; got {obj.get(key)!r}")
        problems.append({"index": n - 1, "question": obj["question"].strip(), "answer": obj["answer"],
                         "truth": final_answer(obj["answer"], where)})
    return problems


def to_row(p: dict, split: str) -> dict:
    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p["question"] + INSTRUCTION}],
            "reward_model": {"style": "rule", "ground_truth": p["truth"]},
            "extra_info": {"split": split, "index": p["index"], "question": p["question"],
                           "answer": p["answer"]}}


def split(problems: list[dict], test_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, test): a seeded shuffle, the first test_size held out, each part in file order."""
    if not 0 < test_size < len(problems):
        raise ConvertError(f"--test-size must be between 1 and {len(problems) - 1} "
                           f"(there are {len(problems)} problems); got {test_size}")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    test = set(order[:test_size])
    return ([p for i, p in enumerate(problems) if i not in test],
            [p for i, p in enumerate(problems) if i in test])


def convert(src: Path, out_dir: Path, test_size: int = 10, seed: int = 0) -> dict[str, int]:
    """Write train.parquet and test.parquet under out_dir; returns the row count of each."""
    train, test = split(read_problems(src), test_size, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, part in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist([to_row(p, name) for p in part]), out_dir / f"{name}.parquet")
        counts[name] = len(part)
    return counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=HERE / "problems.jsonl")
    parser.add_argument("--out-dir", type=Path, default=HERE / "data")
    parser.add_argument("--test-size", type=int, default=10, help="problems held out for evaluation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split")
    args = parser.parse_args(argv)
    try:
        counts = convert(args.src, args.out_dir, args.test_size, args.seed)
    except (ConvertError, OSError) as e:
        print(f"convert.py: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir / 'train.parquet'} ({counts['train']} rows) and "
          f"{args.out_dir / 'test.parquet'} ({counts['test']} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
