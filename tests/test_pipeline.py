"""The pipeline (trainer/pipeline.py): rollout.max_staleness=0 is the synchronous run, bitwise,
whether its generation runs inline or in the generation lane; k >= 1 runs generation ahead,
never trains a sample beyond the bound (checked again by the audit, from the records alone),
and the audit fails on records edited to exceed it."""
import json
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sealrl.audit import audit_run
from sealrl.audit.checks import check_policy_version
from sealrl.audit.folder import load_run
from sealrl.audit.staleness import staleness_distribution
from sealrl.config import ConfigError, build_config, check_config
from sealrl.experience.ids import PolicyVersion
from sealrl.experience.records import StopReason
from sealrl.experience.store import read_iteration
from sealrl.experience.wire import RolloutSample
from sealrl.roles.rollout import Rollout
from sealrl.trainer import driver as driver_module
from sealrl.trainer import pipeline as pipeline_module
from sealrl.trainer.driver import train
from sealrl.trainer.ledger import new_iteration
from sealrl.trainer.pipeline import Produced, admit, staleness, staleness_metrics
from sealrl.trainer.state import IllegalTransition, Phase, StateMachine
from tests.harness import small_args
from tests.test_audit import _iter, _reseal, _rewrite

BASE = small_args("run.iterations=4", "run.loggers=", "run.threads=1", "run.checkpoint_every=2")


def _train(out: Path, name: str, *extra: str) -> tuple[dict, Path]:
    summary = train(build_config(None, BASE + list(extra) + [f"run.output_dir={out}", f"run.name={name}"]))
    return summary, out / name


def _files(run: Path) -> list[bytes]:
    """What a run sealed: each iteration's facts digest and its stored columns."""
    out = []
    for path in sorted((run / "experience").glob("iter_*.parquet")):
        out.append((read_iteration(path).seal_digest, pq.read_table(path).to_pydict()))
    return out


def _numbers(run: Path) -> list[dict]:
    """metrics.jsonl without the timings (seconds, rates, shares: all that may differ between two
    runs), keys in order."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    measured = ("time/", "memory/", "perf/")
    return [[(k, v) for k, v in r.items() if not (k.startswith(measured) or "_s" in k)] for r in rows]


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    """k = 1 and 2 with slow generation (every generate call sleeps) and fast updates."""
    out = tmp_path_factory.mktemp("async_runs")
    real = Rollout.generate

    def slow(self, *args, **kwargs):   # well past an update, even on a loaded machine
        time.sleep(1.0)
        return real(self, *args, **kwargs)
    made = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Rollout, "generate", slow)
        for k in (1, 2):
            made[k] = _train(out, f"k{k}", f"rollout.max_staleness={k}", "run.iterations=5",
                             "algorithm.correction=token_is")[1]
    return made


# ---- k = 0 is the synchronous run ----------------------------------------------------------

def test_k0_through_the_generation_lane_is_bitwise_the_synchronous_run(tmp_path, monkeypatch):
    """The same k = 0 run with generation inline (the synchronous driver's order) and in the
    threaded generation lane: same weights, same sealed experience, same metrics."""
    sync_summary, sync_run = _train(tmp_path / "sync", "k0")

    def threaded(run, start, end, version, recalled=None, schedule=None):
        return _closing(pipeline_module.Pipeline(run, start, end, version, threaded=True))
    monkeypatch.setattr(driver_module, "pipeline", threaded)
    lane_summary, lane_run = _train(tmp_path / "lane", "k0")
    assert lane_summary["weights_hash"] == sync_summary["weights_hash"]
    assert lane_summary["optimizer_steps"] == sync_summary["optimizer_steps"] == 4
    assert _files(lane_run) == _files(sync_run)
    assert _numbers(lane_run) == _numbers(sync_run)
    assert audit_run(lane_run).ok


class _closing:
    def __init__(self, p):
        self.p = p

    def __enter__(self):
        return self.p

    def __exit__(self, *exc):
        self.p.close()


# ---- k >= 1: ahead, within the bound --------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2])
def test_slow_generation_fast_updates_never_exceed_the_bound(async_runs, k):
    run = async_runs[k]
    report = audit_run(run)
    assert report.ok, report.summary()
    consumed = [json.loads(x) for x in (run / "experience" / "consumed.jsonl").read_text().splitlines()]
    steps = [0] + [c["consumed_step"] for c in consumed]     # one optimizer step per iteration here
    assert steps == list(range(6))
    for i in range(5):
        batch = read_iteration(_iter(run, i))
        sampled = {PolicyVersion.from_json(batch.versions[s.policy_version].to_json()).step for s in batch.samples}
        assert sampled == {max(0, i - k)}                   # the fixed lag: k versions behind, never more
        assert steps[i] - sampled.pop() <= k                # actor step when consumed - sampling step
        assert batch.provenance("old_log_probs")[1].startswith(f"k{k}@{steps[i]}.")   # the proximal actor
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness/max"] for m in metrics] == [float(min(i, k)) for i in range(5)]
    assert staleness_distribution(load_run(run)) == {a: 16 for a in range(k)} | {k: 16 * (5 - k)}


def test_generation_runs_ahead_of_the_update(async_runs):
    """With k = 1 the generation of iteration i+1 starts before iteration i's update ends."""
    events = json.loads((async_runs[1] / "trace.json").read_text())["traceEvents"]
    span = {(e["name"], e["args"]["iteration"]): (e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X"}
    for i in range(4):
        assert span[("generate", i + 1)][0] < span[("update", i)][1], i


def test_audit_fails_on_a_record_edited_past_the_bound(async_runs, tmp_path):
    """Iteration 4 of the k = 1 run re-stamped (and re-sealed, as a forger with the code would)
    to claim iteration 3's sampling version (step 2), two versions behind its update's: only the bound
    catches it."""
    run = Path(shutil.copytree(async_runs[1], tmp_path / "k1"))
    older = pq.read_table(_iter(run, 3)).column("policy_version")[0].as_py()
    older_json = json.loads(pq.read_table(_iter(run, 3)).schema.metadata[b"sealrl"])["versions"][older]
    now = pq.read_table(_iter(run, 4)).column("policy_version")[0].as_py()

    def meta(m):
        m["versions"] = {older: older_json}
        for f in m["fields"].values():
            f["version"] = older if f["version"] == now else f["version"]
    _rewrite(_iter(run, 4), lambda c: c.update(policy_version=[older] * len(c["policy_version"])), meta)
    _reseal(_iter(run, 4))
    report = audit_run(run)
    assert report.failed_checks() == ["policy_version"], report.summary()
    assert [v.iteration for v in report.violations] == [4]
    assert "staleness 2 exceeds rollout.max_staleness=1" in report.violations[0].message
    # the same records pass a bound of 2
    folder = load_run(run)
    folder.cfg.rollout.max_staleness = 2
    assert list(check_policy_version(folder)) == []


# ---- the gate where samples are consumed ------------------------------------------------------

def _version(step: int) -> PolicyVersion:
    return PolicyVersion(run_id="r", step=step, attempt=0, weights_hash=f"{step:064x}")


def _produced(by: dict[str, int]) -> Produced:
    """Prompts p0, p1, ... with 2 candidates each, group g sampled by version step by[g]."""
    ledger, requests = new_iteration(5, 2, 0, "r", 0, [(p, (1, 2)) for p in by])
    kept = {g: [RolloutSample(f"{g}/{c}", g, c, (1, 2), (3,), (-0.5,), None, StopReason.EOS,
                              _version(by[g.rsplit("/", 1)[1]]), c) for c in range(2)] for g in requests}
    ledger.commit(list(kept))
    return Produced(5, None, ledger, None, kept, dict(kept), {}, {}, [], dict(ledger.counts()))


def test_staleness_counts_published_versions():
    chain = [_version(s).id for s in (0, 2, 4, 6)]      # e.g. two optimizer steps per iteration
    assert staleness(chain, chain[3], chain[1]) == 2
    assert staleness(chain, chain[1], chain[1]) == 0
    assert staleness(chain, chain[1], chain[3]) == -2   # from the future: never admissible
    assert staleness(chain, chain[1], _version(5).id) is None


def test_a_group_beyond_the_bound_is_dropped_in_the_ledger_never_trained():
    chain = [_version(s).id for s in range(4)]
    p = _produced({"p0": 3, "p1": 2, "p2": 1, "p3": 7})  # actor at step 3, bound 1
    ages = admit(p, chain, chain[3], bound=1)
    assert sorted(p.kept) == ["r/5/p0", "r/5/p1"] and ages == [0, 0, 1, 1]
    rows = {r["prompt_id"]: r for r in p.ledger.rows()}
    assert rows["p2"]["status"] == "dropped" and "2 versions behind" in rows["p2"]["reason"]
    assert rows["p3"]["status"] == "dropped" and "not a published version" in rows["p3"]["reason"]
    assert p.metrics["groups/committed"] == 2 and p.metrics["groups/dropped"] == 2
    assert staleness_metrics(ages, 1) == {"staleness/mean": 0.5, "staleness/max": 1.0,
                                          "staleness/frac_0": 0.5, "staleness/frac_1": 0.5}


# ---- the guard and the engine ---------------------------------------------------------------

def _ready(sm: StateMachine, v: PolicyVersion) -> None:
    sm.to(Phase.EXPORTING, v.id)
    sm.to(Phase.ROLLOUT_LOADING, v.id)
    sm.to(Phase.ROLLOUT_READY, v.id)


@pytest.mark.parametrize("k, ok", [(0, False), (1, True)])
def test_guard_admits_experience_of_the_last_k_plus_one_versions(k, ok):
    v0, v1, v2 = _version(0), _version(1), _version(2)
    sm = StateMachine(max_staleness=k)
    _ready(sm, v0)
    for v, nxt in ((v0, v1), (v1, v2)):
        sm.to(Phase.GENERATING, v.id)
        sm.to(Phase.EXPERIENCE_SEALED, v.id)
        sm.to(Phase.UPDATING_FROM, v.id)
        sm.to(Phase.ACTOR_COMMITTED, f"r@{nxt.step}.0")
        _ready(sm, nxt)
    if ok:
        sm.to(Phase.GENERATING, v1.id)     # one publication behind the active v2
    else:
        with pytest.raises(IllegalTransition, match="the rollout serves"):
            sm.to(Phase.GENERATING, v1.id)
    with pytest.raises(IllegalTransition):
        StateMachine(max_staleness=k).to(Phase.GENERATING, v0.id)


def test_the_rollout_serves_a_retained_version_after_a_publication(tiny_model_dir):
    from sealrl.experience import SamplingContract
    from sealrl.experience.wire import GenerationRequest, VersionNotHeldError
    from sealrl.models.hf import load_causal_lm
    from sealrl.sync.manifest import build_manifest
    model, tok = load_causal_lm(tiny_model_dir)
    rollout = Rollout(model, tok)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    old = rollout.load(state, build_manifest(state, "r", 0, 0, "", ""))
    req, contract = [GenerationRequest("r/0/p", (1, 2, 3), 7, (0, 1))], SamplingContract(max_new_tokens=3)
    before = rollout.generate(req, contract, old)
    newer = {k: v + 0.01 for k, v in state.items()}
    rollout.retain(2)
    rollout.load(newer, build_manifest(newer, "r", 1, 0, "", ""))
    assert rollout.generate(req, contract, old) == before       # the old snapshot, unchanged
    rollout.retain(1)
    with pytest.raises(VersionNotHeldError):
        rollout.generate(req, contract, old)


def test_config_refuses_staleness_with_a_stale_anchor():
    cfg = build_config(None, ["rollout.max_staleness=1", "algorithm.old_log_prob=bypass"])
    with pytest.raises(ConfigError, match="needs algorithm.old_log_prob=recompute"):
        check_config(cfg)
    with pytest.raises(ConfigError, match="needs algorithm.correction=token_is or seq_is"):
        check_config(build_config(None, ["rollout.max_staleness=1"]))
    check_config(build_config(None, ["rollout.max_staleness=2", "algorithm.correction=seq_is"]))
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        build_config(None, ["rollout.max_staleness=-1"])


def test_an_async_run_killed_between_checkpoints_resumes_without_loss_or_duplication(tmp_path, monkeypatch):
    """k = 1, checkpoint every 2 iterations, the process dies before checkpoint 4 while the lane
    has already sampled iteration 4's prompts: the checkpoint records the sampler's position of
    the first unconsumed iteration, so the resumed run trains the same prompts per iteration as
    the run never interrupted (none skipped, none twice: the audit alone counts prompts per
    iteration but cannot name a skipped batch) and stays within the bound. The checkpoint also
    holds the version the lane still samples from, so the weights are the uninterrupted run's
    (every stage: tests/test_exact_resume.py)."""
    real = driver_module.save_position

    def crash(run_dir, iteration, *args, **kwargs):
        if iteration == 4:
            raise RuntimeError("injected crash before checkpoint 4")
        return real(run_dir, iteration, *args, **kwargs)
    extra = ("rollout.max_staleness=1", "algorithm.correction=token_is", "run.iterations=6")
    monkeypatch.setattr(driver_module, "save_position", crash)
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(tmp_path, "crash", *extra)
    monkeypatch.setattr(driver_module, "save_position", real)
    summary, run = _train(tmp_path, "crash", *extra, "run.resume=auto")
    assert summary["completed"] and summary["optimizer_steps"] == 6
    report = audit_run(run)
    assert report.ok, report.summary()
    assert report.num_iterations == 6 and report.num_samples == 6 * 16
    whole_summary, whole = _train(tmp_path / "whole", "crash", *extra)   # the same run, never interrupted
    assert summary["weights_hash"] == whole_summary["weights_hash"]
    prompts = lambda r: [(x["iteration"], x["prompt_id"]) for x in map(json.loads, (r / "ledger.jsonl").open())]  # noqa: E731
    assert prompts(run) == prompts(whole)


def test_a_failure_in_the_generation_lane_is_raised_in_the_training_lane(monkeypatch):
    from types import SimpleNamespace

    from sealrl.obs.timeline import StageTimer
    from sealrl.trainer.pipeline import Pipeline

    def broken(run, it, indices, version):
        raise RuntimeError(f"reward pool gone at iteration {it}")
    monkeypatch.setattr(pipeline_module, "produce", broken)
    sampler = SimpleNamespace(state_dict=lambda: {}, next_batch=lambda: [0])
    run = SimpleNamespace(cfg=build_config(None, ["rollout.max_staleness=1"]), timer=StageTimer(), last_weights=None,
                          roles=SimpleNamespace(rollout=SimpleNamespace(retain=lambda n: None)), sampler=sampler)
    lanes = Pipeline(run, 0, 3, _version(0), threaded=True)
    try:
        with pytest.raises(RuntimeError, match="reward pool gone at iteration 0"):
            lanes.get(0)
    finally:
        lanes.close()
    assert not lanes._thread.is_alive()


def test_the_critical_path_counts_the_generation_lane_only_where_training_waited(async_runs):
    """Slow generation, fast updates: the training lane waits for every iteration, so generation
    holds most of its critical path; the lanes' stages overlap (their shares sum past what the
    iteration took, or near it), the critical shares never do."""
    for run in async_runs.values():
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for r in rows[1:]:   # iteration 0 may find its groups already made (the lane starts first)
            crit = {k: v for k, v in r.items() if k.startswith("time/critical_share_")}
            assert sum(crit.values()) == pytest.approx(1.0, abs=1e-9)   # other closes it
            assert 0 < crit["time/critical_share_generate"] <= r["time/share_generate"] + 1e-9
            assert crit["time/critical_share_generate"] > crit["time/critical_share_update"]


def test_the_report_plots_the_realised_staleness(async_runs):
    from sealrl.obs.report import render
    html = render(async_runs[2])
    chart = next(c for c in html.split('<svg class="chart"') if "Realised staleness" in c)
    assert "versions behind the consuming actor" in chart and "mean" in chart and "max" in chart
    assert "Realised staleness" not in render_sync(async_runs[2])


def render_sync(run: Path) -> str:
    """The same report with the staleness metrics removed (a k = 0 run logs none)."""
    from sealrl.obs.report import render
    copy = run.parent / f"{run.name}_sync_view"
    if not copy.exists():
        shutil.copytree(run, copy)
        rows = [json.loads(x) for x in (copy / "metrics.jsonl").read_text().splitlines()]
        (copy / "metrics.jsonl").write_text("".join(
            json.dumps({k: v for k, v in r.items() if not k.startswith("staleness/")}) + "\n" for r in rows))
    return render(copy)
