"""Asynchronous runs (rollout.max_staleness=1) with the variants that sample more than one
round per iteration: DAPO dynamic sampling (further prompt rounds) and ReMax (a greedy response
per prompt). Both run whole inside the generation lane's produce(), under the version that
sampled the iteration, and draw their extra prompts from the sampler in the lane's order, so a
run killed between checkpoints resumes to the uninterrupted run's weights and ledger, and the
audit passes."""
import json

import pytest

from sealrl.audit import audit_run
from sealrl.trainer import driver as driver_module
from tests.test_pipeline import _train

pytestmark = pytest.mark.slow   # three 6-iteration runs per variant

VARIANTS = {   # rounds of 8 candidates: the tiny policy's groups are often all right or all wrong
    "dynamic_sampling": ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=4", "rollout.n=8",
                         "actor.micro_batch_size=8"],
    "remax": ["algorithm.name=remax"],
}
ASYNC = ["rollout.max_staleness=1", "algorithm.correction=token_is", "run.iterations=6"]


def _ledger(run) -> list[tuple]:
    return [(x["iteration"], x["prompt_id"], x["status"]) for x in map(json.loads, (run / "ledger.jsonl").open())]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_async_variant_killed_between_checkpoints_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch,
                                                                                       variant):
    real = driver_module.save_position

    def crash(run_dir, iteration, *args, **kwargs):
        if iteration == 4:
            raise RuntimeError("injected crash before checkpoint 4")
        return real(run_dir, iteration, *args, **kwargs)
    extra = (*ASYNC, *VARIANTS[variant])
    monkeypatch.setattr(driver_module, "save_position", crash)
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(tmp_path, "crash", *extra)
    monkeypatch.setattr(driver_module, "save_position", real)
    summary, run = _train(tmp_path, "crash", *extra, "run.resume=auto")
    whole_summary, whole = _train(tmp_path / "whole", "crash", *extra)
    assert summary["completed"] and summary["optimizer_steps"] == whole_summary["optimizer_steps"] == 6
    assert summary["weights_hash"] == whole_summary["weights_hash"]
    assert _ledger(run) == _ledger(whole)   # every round's prompts, once each, with the same outcome
    for r in (run, whole):
        report = audit_run(r)
        assert report.ok, report.summary()
    consumed = [json.loads(x) for x in (whole / "experience" / "consumed.jsonl").read_text().splitlines()]
    sampled = [c["sampled_by"].split("#")[0] for c in consumed]
    committed = [c["committed"] for c in consumed]
    assert sampled[1] == sampled[0] and sampled[2:] == committed[:-2]   # one publication behind, throughout
    if variant == "dynamic_sampling":
        assert any(status == "filtered" for *_, status in _ledger(whole))   # the extra rounds ran
