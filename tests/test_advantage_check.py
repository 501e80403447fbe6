"""benchmarks/advantage_check.py: a GRPO run's sealed rewards, loss masks and advantages are what
TRL's GRPOTrainer computes from the same responses (learn_real's reward, TRL's group formula);
an estimator without TRL's scaling is told apart. The embedded model with learn_real's reward."""
from pathlib import Path

from tests.harness import embedded_run, load_benchmark

check = load_benchmark("advantage_check")
ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ("run.iterations=2", "data.prompts_per_iter=8", "rollout.temperature=1.5",
            f"reward.fn={ROOT / 'benchmarks' / 'learn_real_reward.py'}:compute_score")
TOKENIZER = ROOT / "sealrl" / "assets" / "arith-tiny"


def test_a_grpo_run_carries_trls_rewards_masks_and_advantages(tmp_path):
    out = check.check(embedded_run(tmp_path / "grpo", *WORKLOAD), TOKENIZER)
    assert out["iterations"] == 2 and out["samples"] == 2 * 8 * 8
    assert out["reward_mismatch"] == 0 and out["mask_mismatch"] == 0
    # sealrl divides by std + 1e-6, TRL by std + 1e-4: with 0/1 rewards in a group of 8 the std
    # is at least 0.354 and |A| at most 2.47, so the two differ by at most 2.47 * 1e-4 / 0.354 < 1e-3.
    assert out["max_abs_advantage_diff"] < 1e-3
    rloo = check.check(embedded_run(tmp_path / "rloo", *WORKLOAD, "algorithm.name=rloo"), TOKENIZER)
    assert rloo["reward_mismatch"] == 0 and rloo["max_abs_advantage_diff"] > 0.1
