"""The fused old-log-prob forward (one optimizer step over one micro-batch: the recompute
forward is the update's own forward, run once) changes nothing: stored old log-probs, metrics
and trained weights are bitwise those of the two-forward path, also across a rolled-back update."""
import json

import pytest
import torch
from safetensors.torch import load_file

from sealrl.config import build_config
from sealrl.experience.store import read_iteration
from sealrl.models import lean_forward
from sealrl.roles.actor import Actor
from sealrl.trainer.driver import train
from sealrl.trainer.iteration_metrics import is_wall_clock
from tests.harness import small_args

BASE = small_args("run.iterations=3", "run.seed=3", "algorithm.old_log_prob=recompute", "algorithm.kl_coef=0.05",
                  "algorithm.kl_in=loss", "actor.entropy_coef=0.01")


def _run(tmp_path, name, fused: bool, monkeypatch, extra=()):
    calls = []
    original = Actor._one_step
    def one_step(self, b):
        calls.append(original(self, b))
        return fused and calls[-1]
    monkeypatch.setattr(Actor, "_one_step", one_step)
    # one attention kernel for the no-grad pass and the update's forward (the lean forward picks
    # the math kernel for short rows with gradients on only: a rounding difference otherwise)
    monkeypatch.setattr(lean_forward, "MATH_ATTENTION_MAX_LEN", 0)
    train(build_config(None, BASE + list(extra) + [f"run.output_dir={tmp_path}", f"run.name={name}"]))
    run = tmp_path / name
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    olds = [read_iteration(run / "experience" / f"iter_{i:06d}.parquet").get("old_log_probs") for i in range(3)]
    return calls, rows, olds, load_file(run / "model" / "model.safetensors")


@pytest.mark.parametrize("fault", [None, "update@1:raise"])
def test_fused_old_forward_is_bitwise_the_two_forward_path(tmp_path, monkeypatch, fault):
    if fault:
        monkeypatch.setenv("SEALRL_FAULTS", fault)
    calls, rows_a, olds_a, weights_a = _run(tmp_path, "fused", True, monkeypatch)
    assert calls and all(calls)  # 16 samples, micro-batch 16, one epoch: the fused path ran
    if fault:
        from sealrl import faults
        faults._fired.clear()
    _, rows_b, olds_b, weights_b = _run(tmp_path, "plain", False, monkeypatch)
    for a, b in zip(olds_a, olds_b):
        assert torch.equal(a, b)
    for k in weights_a:
        assert torch.equal(weights_a[k], weights_b[k]), k
    learned = lambda r: {k: v for k, v in r.items()  # noqa: E731
                         if k.split("/")[0] in ("actor", "adv", "kl", "reward") and not is_wall_clock(k)}
    assert "actor/pg_loss" in learned(rows_a[0])
    diff = [(k, a[k], b.get(k)) for a, b in zip(rows_a, rows_b) for k in learned(a) if a[k] != b.get(k)]
    # only how it ran differs (a retried update, after its rollback, runs its own forward again)
    assert diff and {(k, b) for k, _, b in diff} == {("actor/reused_old_forward", 0.0)}, diff
    if fault:
        assert rows_a[1]["update/attempts"] == 2


def test_not_fused_when_the_update_takes_several_steps(tmp_path, monkeypatch):
    calls, *_ = _run(tmp_path, "mini", True, monkeypatch, ["actor.mini_batch_size=8"])
    assert calls and not any(calls)
