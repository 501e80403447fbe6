"""`recompute`: re-deriving a run's stored experience without generating again.

Nothing changed -> the stored derived tensors come back bit for bit (GRPO, GRPO with KL in the
reward under an adaptive controller, PPO with KL in the reward). A changed kl_coef moves token
rewards and advantages exactly as the formulas say. Keys that would need new facts are refused.
"""
import argparse
import json

import pyarrow as pa
import pytest
import torch

from sealrl.config import ConfigError, build_config
from sealrl.experience.store import read_iteration, read_table
from sealrl.trainer.driver import train
from sealrl.trainer.offline.recompute import add_parser, recompute_run
from tests.harness import small_args

BASE = small_args("eval.num=8", "run.loggers=", "actor.micro_batch_size=6")
RUNS = {
    "grpo": [],
    # seed 3: the first iteration has groups with mixed rewards, so the policy moves off the reference
    "grpo_kl": ["algorithm.kl_coef=0.05", "algorithm.kl_in=reward", "run.seed=3"],
    # horizon 100 with 16 samples per iteration: beta moves by up to 3.2% per iteration
    "grpo_adaptive": ["algorithm.kl_coef=0.05", "algorithm.kl_in=reward", "algorithm.kl_target=0.001",
                      "algorithm.kl_horizon=100", "run.iterations=3", "run.seed=3"],
    "ppo": ["algorithm.name=ppo", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward", "actor.ppo_epochs=2",
            "actor.mini_batch_size=8"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute_runs")
    for name, extra in RUNS.items():
        train(build_config(None, BASE + extra + [f"run.output_dir={root}", f"run.name={name}"]))
    return root


def _iters(folder):
    return sorted(folder.glob("iter_*.parquet"))


@pytest.mark.parametrize("name", list(RUNS))
def test_nothing_changed_reproduces_the_originals_bitwise(runs, name):
    out = recompute_run(runs / name, [], out_name="same")
    originals, recomputed = _iters(runs / name / "experience"), _iters(out)
    assert [p.name for p in recomputed] == [p.name for p in originals] and originals
    for a, b in zip(originals, recomputed):
        ta, meta_a = read_table(a)
        tb, meta_b = read_table(b)
        assert tb.column_names == ta.column_names + ["extra.recompute_tag"]
        for col in ta.column_names:   # facts, derived tensors, consumed step, extras: all equal
            assert tb.column(col).equals(ta.column(col)), (a.name, col)
        for field in ("advantages", "token_rewards", "scores", "returns"):
            if field in ta.column_names:   # bitwise, not just ==: compare the float32 bytes
                assert _bytes(ta.column(field)) == _bytes(tb.column(field)), field
        assert meta_b["seal_digest"] == meta_a["seal_digest"] and meta_b["fields"] == meta_a["fields"]
    summary = json.loads((out / "recompute.json").read_text())
    assert summary["changed"] == [] and set(summary["max_abs_diff"].values()) == {0.0}
    for row in summary["iterations"]:   # the replayed beta is the one the run used
        assert row["beta"] == row["beta_logged"]
    if name == "grpo_adaptive":
        assert summary["iterations"][-1]["beta"] != 0.05


def _bytes(column):
    arr = column.combine_chunks()
    return (arr.flatten() if pa.types.is_list(arr.type) else arr).to_numpy().tobytes()


def _k3(batch):
    lr = batch.get("ref_log_probs") - batch.get("old_log_probs")
    k3 = (lr.exp() - 1 - lr).clamp(max=10.0)   # k3 = e^x - 1 - x, x = log ref/old; clamped at 10
    return k3 * batch.get("response_mask")


def test_grpo_kl_coef_shifts_the_sequence_score_by_beta_times_summed_kl(runs):
    out = recompute_run(runs / "grpo_kl", ["algorithm.kl_coef=0.2"])
    for path in _iters(out):
        new, old = read_iteration(path), read_iteration(runs / "grpo_kl" / "experience" / path.name)
        mask, kl = new.get("response_mask"), _k3(new)
        torch.testing.assert_close(new.get("scores"), old.get("scores"), rtol=0, atol=0)  # raw scores
        # token rewards: -beta * kl_t everywhere, + score at the last response token
        last = torch.zeros_like(mask)
        last[torch.arange(len(new)), mask.sum(-1) - 1] = True
        expected = -0.2 * kl + last * new.get("scores")[:, None]
        torch.testing.assert_close(new.get("token_rewards"), expected * mask, rtol=1e-5, atol=1e-6)
        # old and new token rewards differ by -(0.2 - 0.05) * kl_t
        torch.testing.assert_close(new.get("token_rewards") - old.get("token_rewards"), -0.15 * kl,
                                   rtol=1e-4, atol=1e-6)
        # advantage: group-normalised (score_i - 0.2 * sum_t kl_it), unbiased std, eps 1e-6
        seq = new.get("scores") - 0.2 * kl.sum(-1)
        groups = {}
        for i, g in enumerate(new.group_ids):
            groups.setdefault(g, []).append(i)
        for idx in groups.values():
            s = seq[idx]
            adv = (s - s.mean()) / (s.std() + 1e-6)
            torch.testing.assert_close(new.get("advantages")[idx], adv[:, None] * mask[idx], rtol=1e-4, atol=1e-5)
    summary = json.loads((out / "recompute.json").read_text())
    assert summary["changed"] == ["algorithm.kl_coef: 0.05 -> 0.2"]
    assert summary["max_abs_diff"]["token_rewards"] > 0.01 and summary["max_abs_diff"]["scores"] == 0.0


def test_ppo_kl_coef_changes_token_rewards_and_returns(runs):
    out = recompute_run(runs / "ppo", ["algorithm.kl_coef=0.5", "algorithm.lam=1.0"], out_name="beta05")
    assert out.name == "beta05"
    for path in _iters(out):
        new, old = read_iteration(path), read_iteration(runs / "ppo" / "experience" / path.name)
        mask, kl = new.get("response_mask"), _k3(new)
        torch.testing.assert_close(new.get("token_rewards") - old.get("token_rewards"), -0.45 * kl,
                                   rtol=1e-4, atol=1e-6)
        # gamma = lam = 1: the return at t is the sum of the remaining token rewards (+ the
        # bootstrap of a truncated response); the advantage is return - value
        rewards, values = new.get("token_rewards"), new.get("values")
        to_go = rewards.flip(-1).cumsum(-1).flip(-1)
        truncated = torch.tensor([not s.stop_reason.terminated for s in new.samples])
        to_go = to_go + (truncated * new.get("last_values"))[:, None]
        torch.testing.assert_close(new.get("returns"), to_go * mask, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(new.get("advantages"), (to_go - values) * mask, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("override, words", [
    ("actor.lr=1e-5", "actor.lr"),
    ("rollout.n=2", "rollout.n"),
    ("algorithm.old_log_prob=bypass", "algorithm.old_log_prob"),
    ("algorithm.reward_error=retry", "algorithm.reward_error"),
    ("algorithm.kl_coef=0.1", "reference"),         # kl_in is loss in this run: check below
    ("algorithm.name=ppo", "critic values"),
    ("algorithm.name=remax", "greedy baselines"),
    ("algorithm.name=optimal_token_baseline", "sum_pi_squared"),
    ("algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling"),
    ("algorithm.no_such_key=1", "algorithm.no_such_key"),
])
def test_keys_that_need_new_facts_are_refused(runs, override, words):
    overrides = [override] + (["algorithm.kl_in=reward"] if "kl_coef" in override else [])
    with pytest.raises(ConfigError, match=words):
        recompute_run(runs / "grpo", overrides)


def test_max_new_tokens_only_moves_the_soft_overlong_penalty(runs):
    out = recompute_run(runs / "grpo", ["rollout.max_new_tokens=6", "algorithm.overlong=soft",
                                        "algorithm.overlong_buffer=2"])
    for path in _iters(out):
        new = read_iteration(path)
        lengths = torch.tensor([len(s.response_ids) for s in new.samples], dtype=torch.float32)
        raw = torch.tensor([r.total for r in new.get("reward_records")], dtype=torch.float32)
        over = ((lengths - 4) / 2).clamp(0, 1)   # ramps over the last 2 of 6 tokens
        torch.testing.assert_close(new.get("scores"), raw - over, rtol=0, atol=1e-6)


def test_cli_subcommand(runs, capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["recompute", str(runs / "grpo_kl"), "--set", "algorithm.kl_coef=0.1",
                              "--set", "algorithm.gamma=0.9", "--name", "cli"])
    assert args.fn(args) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["out"] == str(runs / "grpo_kl" / "recompute" / "cli")
    assert sorted(printed["changed"]) == ["algorithm.gamma: 1.0 -> 0.9", "algorithm.kl_coef: 0.05 -> 0.1"]
