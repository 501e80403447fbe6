"""Partial rollouts (rollout.partial=switch, rollout/switching.py, trainer/variants/partial.py): a row in
flight when a version is published goes on under it from its next token, re-prefilled (never the
old version's KV cache); every token records its version; staleness counts from the oldest one
(admission, audit); a replay follows the recorded switches bitwise."""
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from sealrl.audit import audit_run
from sealrl.audit.folder import load_run
from sealrl.audit.staleness import staleness_distribution
from sealrl.config import ConfigError, build_config, check_config
from sealrl.experience.ids import PolicyVersion
from sealrl.experience.records import SamplingContract, StopReason
from sealrl.experience.store import read_iteration
from sealrl.experience.wire import GenerationRequest, RolloutSample
from sealrl.models.logprobs import response_log_probs
from sealrl.models.tiny import build_tiny_model
from sealrl.rollout import switching
from sealrl.rollout.switching import generate_switching, planned, token_steps
from sealrl.trainer import driver as driver_module
from sealrl.trainer import setup as trainer_setup
from sealrl.trainer.driver import train
from sealrl.trainer.ledger import new_iteration
from sealrl.trainer.offline.replay import recorded_schedule, replay
from sealrl.trainer.pipeline import Produced, admit
from tests.helpers_partial import HeldRollout
from tests.test_audit import _iter, _reseal, _rewrite
from tests.test_pipeline import _train
from tests.test_rollout_engine import encode, make_engine, mixed_requests

SWITCH = ["rollout.max_staleness=1", "algorithm.correction=token_is", "rollout.partial=switch",
          "rollout.max_new_tokens=6"]


# ---- the engine side: one generate call across a switch ------------------------------------

@pytest.fixture(scope="module")
def two_versions():
    """An engine serving v0 (the tiny model) and v1 (its weights moved by 0.05 noise), and both models."""
    model0, tok = build_tiny_model(seed=0)
    model1, _ = build_tiny_model(seed=0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model1.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    engine, v0 = make_engine(model0, tok)
    engine.retain(2)
    manifest = _manifest(model1, tok, 1)
    engine.load_weights(model1.state_dict(), manifest)
    v1 = manifest.version
    return engine, v0, v1, model0.eval(), model1.eval(), tok


def _manifest(model, tok, step):
    from sealrl.models.hf import model_config_hash, tokenizer_hash
    from sealrl.sync.manifest import build_manifest
    return build_manifest(model.state_dict(), "run", step, 0, tokenizer_hash(tok), model_config_hash(model.config))


def _teacher_forced(model, samples, temperature=1.0):
    with torch.no_grad():
        lp, _, _ = response_log_probs(model, [list(s.prompt_ids) for s in samples],
                                      [list(s.response_ids) for s in samples], temperature)
    return lp


def test_a_switch_continues_each_row_under_the_new_version_from_the_next_token(two_versions):
    engine, v0, v1, model0, model1, tok = two_versions
    contract = SamplingContract(max_new_tokens=8)
    requests = mixed_requests(tok)
    alone = engine.generate(requests, contract, v0)   # v0 to the end: the finish mode's call
    switched = generate_switching(engine, requests, contract, v0, planned({3: "v1"}, {"v1": v1}.__getitem__))
    tf0, tf1 = _teacher_forced(model0, switched), _teacher_forced(model1, switched)
    ran_past = 0
    for b, (s, ref) in enumerate(zip(switched, alone)):
        assert s.policy_version == v0                                   # the oldest, where it started
        assert s.response_ids[:3] == ref.response_ids[:3]                # before the switch: v0's call, bitwise
        assert s.rollout_log_probs[:3] == ref.rollout_log_probs[:3]
        n = len(s.response_ids)
        if n > 3:
            ran_past += 1
            assert s.segments == ((0, v0), (3, v1))
            assert token_steps(s) == [0, 0, 0] + [1] * (n - 3)
        else:
            assert s.segments == ((0, v0),)
        lp = torch.tensor(s.rollout_log_probs)
        assert (lp[:min(n, 3)] - tf0[b, :min(n, 3)]).abs().max() < 1e-5       # each token: its own version
        if n > 3:
            assert (lp[3:] - tf1[b, 3:n]).abs().max() < 1e-5                 # v1 on the whole prefix
            assert (lp[3:] - tf0[b, 3:n]).abs().max() > 1e-3                 # and not v0 (nor v0's cache)
    assert ran_past == len(switched)   # the untrained model never stops by 3 tokens here
    assert [s.response_ids for s in switched] != [s.response_ids for s in alone]
    # tokens are a function of (seed, versions, switch points): the same call again is the same
    again = generate_switching(engine, requests, contract, v0, planned({3: "v1"}, {"v1": v1}.__getitem__))
    assert again == switched
    # no switch: bitwise the engine's own generate
    none = generate_switching(engine, requests, contract, v0, planned({}, {}.__getitem__))
    assert [(s.response_ids, s.rollout_log_probs, s.stop_reason) for s in none] == \
           [(s.response_ids, s.rollout_log_probs, s.stop_reason) for s in alone]


def test_a_row_that_stops_before_the_switch_keeps_one_segment(two_versions):
    engine, v0, v1, *_, tok = two_versions
    vocab = len(tok)
    contract = SamplingContract(max_new_tokens=6, stop_token_ids=tuple(range(0, vocab, 2)))  # about half stop each step
    req = [GenerationRequest("run/0/a", encode(tok, "07+45="), seed=5, candidates=tuple(range(8)))]
    out = generate_switching(engine, req, contract, v0, planned({2: "v1"}, {"v1": v1}.__getitem__))
    early = [len(s.response_ids) <= 2 for s in out]   # stopped at token 0 or 1: gone before the switch
    assert 0 < sum(early) < len(out)
    for s, gone in zip(out, early):
        assert s.segments == (((0, v0),) if gone else ((0, v0), (2, v1)))


def test_token_steps_expand_the_segments():
    v = [PolicyVersion(run_id="r", step=k, attempt=0, weights_hash=f"{k:064x}") for k in (3, 4, 6)]
    s = RolloutSample("g/0", "g", 0, (1,), (5, 6, 7, 8, 9), (-1.0,) * 5, None, StopReason.LENGTH, v[0], 0,
                      segments=((0, v[0]), (2, v[1]), (4, v[2])))
    assert token_steps(s) == [3, 3, 4, 4, 6]


# ---- admission counts from the oldest token ---------------------------------------------------

def _version(step):
    return PolicyVersion(run_id="r", step=step, attempt=0, weights_hash=f"{step:064x}")


def test_admission_counts_staleness_from_the_oldest_token_version():
    """chain steps 0, 1, 2; actor at 2; bound 1. Group a: tokens of steps 1 then 2 (age 1, admitted).
    Group b: started at step 0, switched to 2 (its oldest token is 2 versions behind: dropped).
    Group c: switched to step 3, never published (dropped)."""
    chain = [_version(s).id for s in (0, 1, 2)]
    segs = {"a": ((0, _version(1)), (1, _version(2))), "b": ((0, _version(0)), (2, _version(2))),
            "c": ((0, _version(1)), (1, _version(3)))}
    ledger, requests = new_iteration(5, 2, 0, "r", 0, [(p, (1, 2)) for p in segs])
    kept = {g: [RolloutSample(f"{g}/{c}", g, c, (1, 2), (3, 4, 5), (-0.5,) * 3, None, StopReason.EOS,
                              segs[g.rsplit("/", 1)[1]][0][1], c, segments=segs[g.rsplit("/", 1)[1]])
                for c in range(2)] for g in requests}
    ledger.commit(list(kept))
    p = Produced(5, None, ledger, None, kept, dict(kept), {}, {}, [], dict(ledger.counts()))
    ages = admit(p, chain, chain[2], 1)
    assert ages == [1, 1]
    assert [g.rsplit("/", 1)[1] for g in p.kept] == ["a"]
    reasons = [r["reason"] for r in p.ledger.rows() if r["reason"]]
    assert len(reasons) == 2 and "2 versions behind" in reasons[0] and "not a published version" in reasons[1]


def test_config_refuses_switch_where_it_is_not_built():
    for extra, word in [([], "max_staleness"), (["rollout.max_staleness=1", "env.name=calc"], "episodes")]:
        cfg = build_config(None, ["rollout.partial=switch", "algorithm.correction=token_is", *extra])
        with pytest.raises(ConfigError, match=word):
            check_config(cfg)
    with pytest.raises(ConfigError, match="finish or switch"):
        build_config(None, ["rollout.partial=abort"])


# ---- a run: a publication forced mid-generation ---------------------------------------------

@pytest.fixture(scope="module")
def switch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("switch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer_setup, "Rollout", HeldRollout)
        summary, run = _train(out, "sw", *SWITCH, "rollout.temperature=1.5", "actor.lr=1e-2")   # weights that move
    return summary, run


def test_tokens_after_the_switch_carry_the_new_version_and_its_log_probs(switch_run):
    """k = 1: iteration i starts from step i-1 and is consumed by step i, published while it
    generates: its tokens from 2 on are step i's, and their behaviour log-probs are the consuming
    actor's own teacher-forced ones (its old_log_probs, same weights) within 1e-5."""
    assert_switched_at_token_2(switch_run[1])


def assert_switched_at_token_2(run: Path) -> None:
    """Every row of iteration i >= 1 sampled tokens 0-1 with step i-1 and the rest with step i,
    whose log-probs are the consuming actor's own (old_log_probs, same weights) within 1e-5."""
    for i in range(4):
        batch = read_iteration(_iter(run, i))
        tv, lp = batch.get("token_versions"), batch.get("rollout_log_probs")
        old = batch.get("old_log_probs")
        start = max(0, i - 1)
        assert {s.policy_version for s in batch.samples} == {next(v for v, pv in batch.versions.items()
                                                               if pv.step == start)}
        assert batch.provenance("old_log_probs")[1].startswith(f"sw@{i}.")
        for b, s in enumerate(batch.samples):
            n = len(s.response_ids)
            want = [start] * n if i == 0 else [start] * min(n, 2) + [i] * (n - 2)
            assert tv[b, :n].tolist() == want, (i, b)
            if i and n > 2:
                assert (lp[b, 2:n] - old[b, 2:n]).abs().max() < 1e-5
        if i:   # before the switch: the older version's log-probs, not the actor's
            assert (lp[:, :2] - old[:, :2]).abs().max() > 1e-2
        assert sorted(pv.step for pv in batch.versions.values()) == ([0] if i == 0 else [i - 1, i])


def test_the_audit_passes_and_counts_staleness_from_the_oldest_token(switch_run):
    _, run = switch_run
    report = audit_run(run)
    assert report.ok, report.summary()
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # tokens after the switch are 0 versions stale; the sample counts from its first: 1
    assert [m["staleness/max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [m["staleness/mean"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert staleness_distribution(load_run(run)) == {0: 16, 1: 48}


def test_an_edited_token_version_beyond_the_bound_fails_the_audit(switch_run, tmp_path):
    """Iteration 3 (actor step 3, bound 1): token 3 of sample 0 re-stamped to step 1 (declared and
    re-sealed, as a forger with the code would): its oldest token is 2 versions behind."""
    run = Path(shutil.copytree(switch_run[1], tmp_path / "sw"))
    m1 = json.loads(pq.read_table(_iter(run, 2)).schema.metadata[b"sealrl"])["versions"]
    step1 = {k: v for k, v in m1.items() if PolicyVersion.from_json(v).step == 1}

    row = next(r for r, ids in enumerate(pq.read_table(_iter(run, 3)).column("response_ids").to_pylist())
               if len(ids) >= 4)

    def edit(c):
        c["token_versions"][row][3] = 1
    _rewrite(_iter(run, 3), edit, lambda m: m["versions"].update(step1))
    _reseal(_iter(run, 3))
    report = audit_run(run)
    assert report.failed_checks() == ["policy_version"], report.summary()
    assert [(v.iteration, v.sample_id) for v in report.violations] == [(3, read_iteration(_iter(run, 3))
                                                                        .samples[row].sample_id)]
    assert "oldest step 1" in report.violations[0].message
    assert "staleness 2 exceeds rollout.max_staleness=1" in report.violations[0].message


def test_replay_follows_the_recorded_switches_bitwise(switch_run, tmp_path):
    summary, run = switch_run
    schedule = recorded_schedule(run, 4, 1)
    assert schedule.switches == {0: {}, 1: {2: 1}, 2: {2: 2}, 3: {2: 3}}
    result = replay(run, tmp_path / "replay")   # no forced hook: the record's switches only
    assert result["bitwise"] and result["weights_hash"] == summary["weights_hash"]


def test_a_switch_run_killed_and_resumed_loses_and_duplicates_nothing(switch_run, tmp_path, monkeypatch):
    """Killed in iteration 3's update, resumed from checkpoint 2 (the lane ahead of it). The
    audit passes on the same prompts per iteration, each once; the switches are sealed again.
    The forced schedule (token 2, to the version published next) does not depend on timing, so
    here the resume even ends on bitwise the weights; a clock-driven switch would not
    (docs/async.md)."""
    from tests.test_exact_resume import _consumed, _ledger, _on_call
    args = (*SWITCH, "rollout.temperature=1.5", "actor.lr=1e-2")
    monkeypatch.setattr(trainer_setup, "Rollout", HeldRollout)
    real = driver_module.update
    monkeypatch.setattr(driver_module, "update", _on_call(4, real))
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(tmp_path, "sw", *args)
    monkeypatch.setattr(driver_module, "update", real)
    assert (tmp_path / "sw" / "checkpoints" / "latest").read_text() == "step_2"
    summary, run = _train(tmp_path, "sw", *args, "run.resume=auto")
    report = audit_run(run)
    assert report.ok and report.num_iterations == 4 and report.num_samples == 64, report.summary()
    assert _ledger(run) == _ledger(switch_run[1])
    assert [(c["iteration"], c["consumed_step"]) for c in _consumed(run)] == [(i, i + 1) for i in range(4)]
    assert recorded_schedule(run, 4, 1).switches == {0: {}, 1: {2: 1}, 2: {2: 2}, 3: {2: 3}}
    assert summary["weights_hash"] == switch_run[0]["weights_hash"]


def test_switch_mode_without_a_publication_mid_generation_is_the_finish_run(tmp_path, monkeypatch):
    """The switching generator with no switch samples bitwise what the engine's generate does:
    same weights, same tokens and log-probs; only the record gains token_versions."""
    finish, finish_run = _train(tmp_path / "f", "r", *SWITCH[:2], "rollout.max_new_tokens=6")
    monkeypatch.setattr(switching, "live_switch", lambda engine: lambda step, current: None)
    switch, switch_run = _train(tmp_path / "s", "r", *SWITCH)
    assert switch["weights_hash"] == finish["weights_hash"]
    for i in range(4):
        a, b = read_iteration(_iter(finish_run, i)), read_iteration(_iter(switch_run, i))
        assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]
        assert torch.equal(a.get("rollout_log_probs"), b.get("rollout_log_probs"))
        assert not a.has("token_versions") and b.get("token_versions")[b.token_mask()].unique().tolist() == \
            [max(0, i - 1)]


# ---- in the generation process (rollout.lane=process) ------------------------------------------

def test_switch_in_the_generation_process_is_bitwise_the_thread_lane(switch_run, tmp_path, monkeypatch):
    """The same forced switches, decided in the generation process on the loads it receives while
    it samples, its finished rows streamed back to the scorers: the same sealed experience and
    weights as the thread lane's run."""
    from tests.test_pipeline import _files
    monkeypatch.setattr(trainer_setup, "Rollout", HeldRollout)
    summary, run = _train(tmp_path, "sw", *SWITCH, "rollout.temperature=1.5", "actor.lr=1e-2", "rollout.lane=process",
                          "reward.stream=true", "reward.num_scorers=1")
    assert summary["weights_hash"] == switch_run[0]["weights_hash"]
    assert _files(run) == _files(switch_run[1])
    assert audit_run(run).ok


def test_replay_of_the_recorded_switches_in_the_generation_process(switch_run, tmp_path):
    """The thread lane's record replayed with generation in its own process: it waits there for
    each recorded version and switches at the recorded tokens, ending on the same weights."""
    from sealrl.config import load_config
    summary, run = switch_run
    cfg = load_config(str(run / "config.yaml"), [f"run.output_dir={tmp_path}", "run.resume=never",
                                                 "rollout.lane=process"])
    replayed = train(cfg, recorded_schedule(run, 4, 1))
    assert replayed["weights_hash"] == summary["weights_hash"]
    assert [read_iteration(_iter(Path(replayed["run_dir"]), i)).seal_digest for i in range(4)] == \
        [read_iteration(_iter(run, i)).seal_digest for i in range(4)]


def test_a_lora_switch_run_switches_audits_and_replays_bitwise(tmp_path, monkeypatch):
    """With LoRA each version is base + adapter, merged in the rollout: the switch, the per-token
    log-probs (the consuming actor's own after it, within 1e-5) and the replay hold the same."""
    monkeypatch.setattr(trainer_setup, "Rollout", HeldRollout)
    summary, run = _train(tmp_path, "sw", *SWITCH, "rollout.temperature=1.5", "actor.lr=1e-2", "actor.lora.rank=4")
    monkeypatch.undo()
    assert audit_run(run).ok
    assert recorded_schedule(run, 4, 1).switches == {0: {}, 1: {2: 1}, 2: {2: 2}, 3: {2: 3}}
    batch = read_iteration(_iter(run, 3))
    after = (batch.get("token_versions") == 3) & batch.token_mask()
    assert after.any()
    assert (batch.get("rollout_log_probs") - batch.get("old_log_probs"))[after].abs().max() < 1e-5
    assert replay(run, tmp_path / "replay")["weights_hash"] == summary["weights_hash"]


def assert_same_tokens_and_versions(run: Path, want: Path) -> None:
    """`run` batched its rows otherwise than `want` (other row counts per matmul). On some CPUs
    (AMD EPYC, not the Intel Xeons seen) a row's float32 log-probs then move by rounding, the
    token-level IS weights carry that into the update, and the weights, their version hashes and
    the later log-probs drift by more than rounding. What must hold on any CPU: the same samples,
    tokens, stop reasons, rewards and token versions, each version at the same step; iteration
    0's rollout log-probs (one version, the same weights) within float32 rounding."""
    from tests.test_pipeline import _files
    drifting = ("rollout_log_probs", "old_log_probs")
    for i, ((_, got), (_, ref)) in enumerate(zip(_files(run), _files(want), strict=True)):
        if i == 0:
            for a, b in zip(sum(got["rollout_log_probs"], []), sum(ref["rollout_log_probs"], []), strict=True):
                assert abs(a - b) <= 64 * 2 ** -23 * max(1.0, abs(b)), (a, b)
        for row in (got, ref):
            for key in drifting:
                row.pop(key)
            row["policy_version"] = [v.split("#")[0] for v in row["policy_version"]]   # run@step.attempt
        assert got == ref, i


def test_switch_in_waves_of_bounded_rows_switches_each_wave_and_replays(switch_run, tmp_path, monkeypatch):
    """rollout.max_rows=8: the 16 rows of an iteration decode in two waves, each from the
    iteration's version; the forced switch moves each wave at token 2 (the second wave finds the
    new version active already): the one-loop run's tokens and versions, and a bitwise replay."""
    monkeypatch.setattr(trainer_setup, "Rollout", HeldRollout)
    summary, run = _train(tmp_path, "sw", *SWITCH, "rollout.temperature=1.5", "actor.lr=1e-2", "rollout.max_rows=8")
    assert_switched_at_token_2(run)
    assert_same_tokens_and_versions(run, switch_run[1])
    assert audit_run(run).ok
    monkeypatch.undo()
    result = replay(run, tmp_path / "replay")
    assert result["bitwise"] and result["weights_hash"] == summary["weights_hash"]


def test_streamed_scoring_of_a_switch_run_is_bitwise_the_unstreamed(switch_run, tmp_path, monkeypatch):
    """reward.stream with rollout.partial=switch: rows that finish in any segment go to the
    scorers while the others decode; the sealed experience and weights are the inline run's."""
    from tests.test_pipeline import _files
    from tests.test_reward_stream import recorded_takes
    takes = recorded_takes(monkeypatch)
    monkeypatch.setattr(trainer_setup, "Rollout", HeldRollout)
    summary, run = _train(tmp_path, "sw", *SWITCH, "rollout.temperature=1.5", "actor.lr=1e-2", "reward.stream=true",
                          "reward.num_scorers=1")
    assert summary["weights_hash"] == switch_run[0]["weights_hash"]
    assert _files(run) == _files(switch_run[1])
    assert takes == [(16, 0)] * 4   # 4 iterations of 4 prompts x 4: every record came from the stream
    assert audit_run(run).ok


# ---- on a Ray pool of two replicas -----------------------------------------------------------

@pytest.mark.slow
def test_switch_on_two_ray_replicas_matches_the_thread_lane_and_replays(switch_run, tmp_path, monkeypatch,
                                                                          shared_ray):
    """The same forced switches, decided on each replica on the activation the pool sends it
    while that replica samples its shard: the one-process run's samples, tokens and token
    versions (assert_same_tokens_and_versions); its record replays on the pool (every replica
    waits for the recorded versions there), bitwise."""
    pytest.importorskip("ray", reason="placement.backend=ray needs ray (the test extra)")
    ray = ["placement.backend=ray", "placement.rollout_replicas=2", "placement.num_cpus=2",
           "placement.cpus_per_replica=0.5", "placement.timeout_s=120"]
    monkeypatch.setattr(trainer_setup, "Rollout", HeldRollout)   # pickled by name into each replica
    summary, run = _train(tmp_path, "sw", *SWITCH, "rollout.temperature=1.5", "actor.lr=1e-2", *ray)
    # 8 rows per replica instead of 16: the matmuls block differently
    assert_switched_at_token_2(run)
    assert_same_tokens_and_versions(run, switch_run[1])
    served = [json.loads(x) for x in (run / "served.jsonl").read_text().splitlines()]
    assert {k for row in served for k in row["replica_of"].values()} == {0, 1}   # both replicas switched
    assert audit_run(run).ok
    monkeypatch.undo()
    result = replay(run, tmp_path / "replay")   # no forced hook: the record's switches only
    assert result["bitwise"] and result["weights_hash"] == summary["weights_hash"]
