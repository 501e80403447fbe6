"""Multi-turn end to end: a training run whose episodes really go over several turns passes
every audit check; a record edited to train an observation token fails it; a resumed
multi-turn run equals the straight one bitwise."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from sealrl.audit import audit_run
from sealrl.config import build_config
from sealrl.envs.base import EnvStep
from sealrl.experience.episode import EnvStatus
from sealrl.obs.report import write_report
from sealrl.trainer.driver import train


class DigitEnv:
    """Every policy turn ends at its first digit and is answered "=x;" (the turn budget ends it)."""

    name, version, stops = "digits", "1", tuple("0123456789")

    def reset(self, prompt):
        return None

    def step(self, state, text):
        return EnvStep("=x;", reward=0.25) if text[-1:].isdigit() else EnvStep(done=True, status=EnvStatus.NONE)

    def close(self):
        pass


def cfg(tmp_path, model_dir, *extra):
    return build_config(None, [
        f"model.path={model_dir}", f"run.output_dir={tmp_path}", "run.name=mt", "run.iterations=2",
        "run.checkpoint_every=1", "run.threads=1", "data.num_train=32", "eval.num=8",
        "data.prompts_per_iter=4", "rollout.n=2", "rollout.max_new_tokens=6", "actor.micro_batch_size=8",
        f"env.name={__file__}:DigitEnv", "env.max_turns=3", "env.max_tokens=20", "env.max_observation_tokens=2",
        *extra])


def test_multi_turn_run_passes_the_audit_and_an_edited_one_fails(tmp_path, tiny_model_dir):
    train(cfg(tmp_path, tiny_model_dir, "run.loggers="))
    run = tmp_path / "mt"
    report = audit_run(run)
    assert report.ok, report.summary()
    path = run / "experience" / "iter_000001.parquet"
    table = pq.read_table(path)
    episodes = [json.loads(e) for e in table.column("episodes").to_pylist()]
    assert max(len(e["turns"]) for e in episodes) > 1                 # really multi-turn
    assert any(t["obs_truncated"] for e in episodes for t in e["turns"])   # "=x;" cut to 2 tokens
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["episode/turns_mean"] > 1 and metrics[-1]["episode/observation_tokens"] > 0
    html = write_report(run).read_text()     # the conversation table, decoded with the run's tokenizer
    assert "Episodes (last iteration)" in html and "=x" in html and "[truncated]" in html
    # edit: train the first observation token of a multi-turn row
    rows = table.to_pylist()
    i = next(k for k, e in enumerate(episodes) if len(e["turns"]) > 1)
    at = len(episodes[i]["turns"][0]["ids"])
    rows[i]["response_mask"][at] = True
    pq.write_table(table.from_pylist(rows, schema=table.schema), path)
    bad = audit_run(run)
    found = [v for v in bad.violations if v.check == "episodes"]
    assert found and "observation tokens [" in found[0].message and "carry loss, KL and entropy" in found[0].message
    assert any(v.check == "seal" for v in bad.violations)


@pytest.mark.slow
def test_resumed_multi_turn_run_equals_the_straight_run(tmp_path, tiny_model_dir):
    straight = train(cfg(tmp_path / "a", tiny_model_dir, "run.iterations=4", "run.loggers="))
    train(cfg(tmp_path / "b", tiny_model_dir, "run.iterations=2", "run.loggers="))
    resumed = train(cfg(tmp_path / "b", tiny_model_dir, "run.iterations=4", "run.resume=auto", "run.loggers="))
    assert resumed["weights_hash"] == straight["weights_hash"]
    assert audit_run(tmp_path / "b" / "mt").ok
