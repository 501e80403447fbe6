"""Synthetic tasks: golden rows, determinism, and train/test disjointness."""
import hashlib
import re
from collections import Counter

import pytest

from sealrl.data.tasks import EMBEDDED_TASK, make_task, split_of


def test_arith_golden_rows():
    rows = make_task("arith", "train", num=2, seed=0)
    # 26+1 = 27 -> padded to width 3 "027" -> reversed "720".
    assert rows[0] == {
        "id": "arith-02d638e44bce",
        "prompt": [{"role": "user", "content": "26+01="}],
        "data_source": "arith",
        "reward_model": {"ground_truth": "720", "style": "rule"},
        "extra_info": {"index": 0, "split": "train", "problem": "26+1", "answer": 27},
    }
    assert rows[1]["prompt"][0]["content"] == "07+60="
    assert rows[1]["reward_model"]["ground_truth"] == "760"  # 67 -> "067" -> "760"


def test_arith_options_golden():
    rows = make_task("arith", "train", num=2, seed=7, ops="+-*", num_operands=3,
                     reverse_answer=False, pad_answer=False, pad_operands=False)
    assert [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows] == [
        ("89*0*56=", "0"), ("75-65-50=", "-40")]


def test_arith_answers_are_correct_for_every_format():
    for opts in (dict(), dict(ops="+-*", num_operands=3), dict(digits=3, reverse_answer=False)):
        for r in make_task("arith", "train", num=200, seed=3, **opts):
            truth, value = r["reward_model"]["ground_truth"], r["extra_info"]["answer"]
            assert value == eval(r["extra_info"]["problem"])  # test-only check of precedence
            digits = truth.lstrip("-")
            if opts.get("reverse_answer", True):
                digits = digits[::-1]
            assert int(digits) * (-1 if truth.startswith("-") else 1) == value


def test_embedded_format_has_fixed_width():
    rows = EMBEDDED_TASK.eval_rows()
    assert len(rows) == EMBEDDED_TASK.eval_num == 500
    assert {len(r["prompt"][0]["content"]) for r in rows} == {6}
    assert {len(r["reward_model"]["ground_truth"]) for r in rows} == {3}
    assert all(re.fullmatch(r"\d\d\+\d\d=", r["prompt"][0]["content"]) for r in rows)
    # The demo's held-out set must never change silently: pin it.
    ids = hashlib.sha256(",".join(r["id"] for r in rows).encode()).hexdigest()[:16]
    assert ids == EMBEDDED_IDS_DIGEST


EMBEDDED_IDS_DIGEST = "fa076bbd8fa0088e"


def test_deterministic_and_seed_dependent():
    assert make_task("arith", "train", 50, seed=1) == make_task("arith", "train", 50, seed=1)
    assert make_task("arith", "train", 50, seed=1) != make_task("arith", "train", 50, seed=2)
    assert make_task("countdown", "test", 20, seed=1) == make_task("countdown", "test", 20, seed=1)


@pytest.mark.parametrize("name", ["arith", "countdown"])
def test_train_and_test_are_disjoint_across_seeds(name):
    train = {r["extra_info"]["problem"] for s in range(3) for r in make_task(name, "train", 2000, s)}
    test = {r["extra_info"]["problem"] for s in range(3) for r in make_task(name, "test", 300, s)}
    assert not train & test
    assert all(split_of(name, p, 0.1) == "test" for p in test)
    # Rows within a set are distinct problems with distinct ids.
    rows = make_task(name, "train", 2000, 0)
    assert len({r["id"] for r in rows}) == len({r["extra_info"]["problem"] for r in rows}) == 2000


def test_test_fraction_is_respected():
    # 2-digit addition has 10,000 problems; about 10% of them hash into test.
    space = [f"{a}+{b}" for a in range(100) for b in range(100)]
    num_test = Counter(split_of("arith", p, 0.1) for p in space)["test"]
    assert 900 < num_test < 1100
    with pytest.raises(ValueError, match="distinct test problems"):
        make_task("arith", "test", num=2000, seed=0)


def test_countdown_golden_and_solvable():
    rows = make_task("countdown", "train", num=200, seed=0)
    assert rows[0]["prompt"] == [{"role": "user", "content": "use 4,3,5,12 to make 19:"}]
    assert rows[0]["reward_model"] == {"ground_truth": {"target": 19, "numbers": [4, 3, 5, 12]},
                                       "style": "rule"}
    assert rows[0]["extra_info"]["solution"] == "(4*3)-(5-12)"
    for r in rows:
        truth, solution = r["reward_model"]["ground_truth"], r["extra_info"]["solution"]
        assert 3 <= len(truth["numbers"]) <= 4 and all(1 <= n <= 20 for n in truth["numbers"])
        assert 1 <= truth["target"] <= 100
        assert eval(solution) == truth["target"]  # test-only: digits, + - * and parentheses
        used = sorted(int(x) for x in re.findall(r"\d+", solution))
        assert used == sorted(truth["numbers"])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="did you mean 'reverse_answer'"):
        make_task("arith", reverse_answr=False)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("sudoku")
    with pytest.raises(ValueError, match="split"):
        make_task("arith", split="valid")
    with pytest.raises(ValueError, match="ops"):
        make_task("arith", ops="/")
