"""Every algorithm and option the config offers runs through the driver, records the right
fields with the right producers, and produces finite metrics (warm-start model, seconds)."""
import json
import math
import re
from pathlib import Path

import pytest

from sealrl.audit import audit_run
from sealrl.config import build_config
from sealrl.experience.store import read_iteration, read_table
from sealrl.trainer.driver import train
from tests.harness import small_args

BASE = small_args("eval.num=8", "actor.micro_batch_size=6")

CASES = {
    "grpo": [],
    "dr_grpo": ["algorithm.name=dr_grpo", "actor.loss_agg=seq-mean-token-sum-norm"],
    "rloo": ["algorithm.name=rloo", "actor.loss_agg=seq-mean-token-mean"],
    "reinforce_pp": ["algorithm.name=reinforce_pp", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward"],
    "reinforce_pp_baseline": ["algorithm.name=reinforce_pp_baseline", "algorithm.kl_coef=0.05",
                              "algorithm.kl_in=reward", "algorithm.kl_estimator=k2"],
    "ppo": ["algorithm.name=ppo", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward", "critic.value_clip=0.2",
            "actor.ppo_epochs=2", "actor.mini_batch_size=8"],
    "grpo_kl_loss": ["algorithm.kl_coef=0.1", "algorithm.kl_in=loss", "algorithm.kl_estimator=k3+",
                     "algorithm.kl_target=0.01"],
    "bypass": ["algorithm.old_log_prob=bypass"],
    "token_is": ["algorithm.correction=token_is"],
    "seq_reject": ["algorithm.correction=seq_reject", "algorithm.correction_threshold=0.5"],
    "overlong_soft": ["algorithm.overlong=soft", "algorithm.overlong_buffer=2", "rollout.max_new_tokens=4"],
    "overlong_mask": ["algorithm.overlong=mask", "rollout.max_new_tokens=4"],
    "clip_higher_entropy_dual": ["actor.clip_high=0.28", "actor.entropy_coef=0.01", "actor.dual_clip=3.0",
                                 "actor.lr_schedule=cosine", "actor.warmup_steps=1"],
    "gspo": ["actor.loss=gspo", "actor.clip_low=3e-4", "actor.clip_high=4e-4", "actor.loss_agg=seq-mean-token-mean"],
    "pg_top_k": ["actor.loss=pg", "rollout.top_k=5", "rollout.top_p=0.9"],
    # verl's estimators and loss modes (sealrl.algos.baselines, .surrogates)
    "remax": ["algorithm.name=remax", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward"],
    "opo_sapo": ["algorithm.name=opo", "actor.loss=sapo", "actor.loss_agg=seq-mean-token-mean"],
    "gpg": ["algorithm.name=gpg", "actor.loss=pg"],
    "passk_cispo": ["algorithm.name=grpo_passk", "actor.loss=cispo"],
    "otb_gmpo": ["algorithm.name=optimal_token_baseline", "actor.loss=gmpo", "actor.clip_low=0.4",
                 "actor.clip_high=0.4", "actor.loss_agg=seq-mean-token-mean"],
    "clip_cov": ["actor.loss=clip_cov", "actor.cov_ratio=0.2"],
    "kl_cov": ["actor.loss=kl_cov", "actor.cov_ratio=0.2"],
}


def documented(text: str) -> list[re.Pattern]:
    """The keys docs/metrics.md defines, as patterns: each backticked `section/key`, each `_suffix`
    after one on its line (`rollout/response_len_mean`, `_p50` -> rollout/response_len_p50),
    `<name>` a placeholder, `*` any ending."""
    keys = []
    for line in text.splitlines():
        last = None
        for tok in re.findall(r"`([^`]+)`", line):
            if re.fullmatch(r"[a-z0-9_]+/\S+", tok):
                keys.append(last := tok)
            elif tok.startswith("_") and last is not None:
                keys += [last[:i] + tok for i, ch in enumerate(last) if ch == "_" and "/" not in last[i:]]
    return [re.compile(re.sub(r"<[a-z]+>", "[^/]+", re.escape(k).replace(r"\*", ".+").replace(r"\<", "<")
                              .replace(r"\>", ">"))) for k in keys]


DOCUMENTED = documented((Path(__file__).parents[1] / "docs" / "metrics.md").read_text())


def test_documented_patterns():
    ok = lambda key: any(p.fullmatch(key) for p in DOCUMENTED)  # noqa: E731
    assert ok("rollout/response_len_p90") and ok("prep/reference_queue_s") and ok("logprob/old_vs_rollout_k3")
    assert ok("actor/ratio_p99") and not ok("actor/ratio_p98") and not ok("actor/made_up")


@pytest.mark.parametrize("name", list(CASES))
def test_algorithm_runs_and_records_provenance(tmp_path, name):
    cfg = build_config(None, BASE + CASES[name] + [f"run.output_dir={tmp_path}", f"run.name={name}"])
    summary = train(cfg)
    run = tmp_path / name
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and summary["iterations"] == 2
    for row in rows:
        for key, value in row.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
        # every key is defined in docs/metrics.md ("iteration" is the row's index)
        assert not [k for k in row if k != "iteration" and not any(p.fullmatch(k) for p in DOCUMENTED)]
    batch = read_iteration(run / "experience" / "iter_000001.parquet")
    _, meta = read_table(run / "experience" / "iter_000001.parquet")
    fields = meta["fields"]
    old_producer = "rollout" if cfg.algorithm.old_log_prob == "bypass" else "actor"
    assert fields["old_log_probs"]["producer"] == old_producer
    assert fields["old_log_probs"]["version"] == batch.samples[0].policy_version
    assert ("ref_log_probs" in fields) == (cfg.algorithm.kl_coef > 0)   # no reference model when beta = 0
    if "ref_log_probs" in fields:
        assert fields["ref_log_probs"]["producer"] == "reference"
        assert fields["ref_log_probs"]["version"].startswith("reference@0.0#")
    assert ("values" in fields) == ("returns" in fields) == (cfg.algorithm.name == "ppo")
    assert ("filtered_log_probs" in fields) == (cfg.rollout.top_k > 0)
    assert ("sum_pi_squared" in fields) == (cfg.algorithm.name == "optimal_token_baseline")
    assert rows[1]["actor/lr"] > 0 and rows[0]["groups/committed"] == 4
    report = audit_run(run)
    assert report.ok, report.summary()
