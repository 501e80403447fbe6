"""Every episode starts from its dataset row, whichever stage made the request: the first
round of an iteration, DAPO's further rounds (trainer/variants/dynamic.py) and ReMax's greedy baselines
(trainer/variants/remax.py) all build their requests with the row (ledger.new_iteration, remax._greedy)."""
from __future__ import annotations

import json
import os
from collections import Counter

from sealrl.config import build_config
from sealrl.envs.calc import CalcEnv
from sealrl.trainer.driver import train
from tests.harness import small_args

BASE = small_args("run.threads=1", "actor.micro_batch_size=8", f"env.name={__file__}:StrictCalc", "env.max_turns=2",
                  "env.max_tokens=16", "rollout.n=8", "actor.lr=1e-4")


class StrictCalc(CalcEnv):
    """calc, refusing an episode started without its row; writes each start's prompt id to
    the file named by SEALRL_TEST_RESETS."""

    name = "strict_calc"

    def reset(self, prompt):
        if prompt.ground_truth is None or not prompt.text or not prompt.data_source:
            raise ValueError(f"episode {prompt.prompt_id!r} started without its dataset row")
        with open(os.environ["SEALRL_TEST_RESETS"], "a") as f:
            f.write(prompt.prompt_id + "\n")
        return super().reset(prompt)


def _run(tmp_path, monkeypatch, name: str, *extra) -> tuple[list[dict], Counter]:
    resets = tmp_path / f"{name}_resets.txt"
    monkeypatch.setenv("SEALRL_TEST_RESETS", str(resets))
    train(build_config(None, BASE + [f"run.output_dir={tmp_path}", f"run.name={name}", *extra]))
    ledger = [json.loads(line) for line in (tmp_path / name / "ledger.jsonl").read_text().splitlines()]
    return ledger, Counter(resets.read_text().split())


def test_dynamic_sampling_rounds_carry_the_row(tmp_path, monkeypatch):
    ledger, resets = _run(tmp_path, monkeypatch, "dapo", "rollout.n=8", "algorithm.dynamic_sampling=true",
                          "algorithm.max_sampling_rounds=4")
    assert any(g["round"] > 0 for g in ledger)                      # dynamic.py made requests too
    assert not [g for g in ledger if g["reason"].startswith("rollout incomplete")]
    for prompt_id, n in Counter(g["prompt_id"] for g in ledger).items():
        assert resets[prompt_id] == 8 * n                           # every candidate started from its row


def test_remax_greedy_requests_carry_the_row(tmp_path, monkeypatch):
    ledger, resets = _run(tmp_path, monkeypatch, "remax", "rollout.n=4", "algorithm.name=remax")
    assert ledger and all(g["status"] == "committed" and g["baseline"] is not None for g in ledger)
    for g in ledger:                                                # 4 candidates + the greedy response
        assert resets[g["prompt_id"]] == 5


def test_new_iteration_requests_carry_the_row_of_dataset_prompts():
    from sealrl.data.dataset import Prompt
    from sealrl.trainer.ledger import new_iteration
    p = Prompt("p7", (), "12*3=", (5, 6), "mul3", "36", {})
    _, reqs = new_iteration(0, 2, 0, "run", 0, [p, ("bare", (1, 2))])
    assert json.loads(reqs["run/0/p7"].env_input) == {"prompt_id": "p7", "text": "12*3=", "ground_truth": "36",
                                                     "data_source": "mul3"}
    assert reqs["run/0/bare"].env_input == "" and reqs["run/0/p7"].prompt_ids == (5, 6)
