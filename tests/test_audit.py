"""`sealrl audit`: passes on run folders the driver writes (GRPO+KL, PPO, reward errors under
both policies, bypass, soft overlong, a resumed run) and fails, naming the check, on folders
corrupted in each way the audit exists to catch. Runs are built once per module (seconds) and
copied per test."""
import argparse
import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sealrl import faults
from sealrl.audit import CHECK_NAMES, add_parser, audit_run
from sealrl.config import build_config
from sealrl.experience.ids import digest
from sealrl.experience.store import read_iteration
from sealrl.rewards.verifiers import answer_text
from sealrl.trainer import driver as driver_module
from sealrl.trainer import setup as trainer_setup
from sealrl.trainer.driver import train
from tests.harness import small_args

BASE = small_args("run.iterations=3", "run.loggers=")

FLAKY = ["reward.fn=tests.test_audit:flaky_arith"]   # a user reward function, from config
RUNS = {
    "grpo_kl": ["algorithm.kl_coef=0.05"],
    "ppo": ["algorithm.name=ppo", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward",
            "actor.ppo_epochs=2", "actor.mini_batch_size=8", "critic.ppo_epochs=1", "critic.mini_batch_size=4",
            "critic.micro_batch_size=3"],   # the critic's own batches
    # errored rewards kept with the explicit penalty, soft overlong, old = rollout (bypass)
    "penalty": [*FLAKY, "algorithm.reward_error=penalty", "algorithm.reward_error_penalty=-0.5",
                "algorithm.overlong=soft", "algorithm.overlong_buffer=2", "rollout.max_new_tokens=4",
                "algorithm.old_log_prob=bypass"],
    "drop": [*FLAKY, "algorithm.reward_error=drop_group"],
    # filtered sampling records filtered_log_probs too
    "rloo_top_k": ["algorithm.name=rloo", "rollout.top_k=5", "rollout.top_p=0.9", "actor.loss=pg"],
    # recovered faults (FAULTS): a failed generate call regenerated, a reward-role failure
    # re-scored, a failed update rolled back and retried as attempt 1
    "faults": ["algorithm.reward_error=retry"],
    # scorer processes: served.jsonl says which one answered each sample (the scorers check)
    "scorers": [*FLAKY, "reward.num_scorers=1", "algorithm.reward_error=retry"],
}
FAULTS = "generate@2:raise,reward@1:raise,update@1:raise"


def flaky_arith(response, ground_truth, sample_id):
    """The arithmetic verifier, but candidate 1 of every other prompt gets no valid score."""
    group, _, cand = sample_id.rpartition("/")
    if cand == "1" and int(digest(group), 16) % 2 == 0:
        return None        # an error record, not a score
    return float(answer_text(response) == str(ground_truth).strip())


def _train(out: Path, name: str, extra: list[str]) -> Path:
    train(build_config(None, BASE + extra + [f"run.output_dir={out}", f"run.name={name}"]))
    return out / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("audit_runs")
    made = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, extra in RUNS.items():
            mp.setattr(faults, "_fired", set())      # entries fire once per process
            if name == "faults":
                mp.setenv("SEALRL_FAULTS", FAULTS)
            made[name] = _train(out, name, extra)
    # resumed: 2 iterations, then continue to 3 from the final checkpoint
    _train(out, "resumed", ["run.iterations=2"])
    made["resumed"] = _train(out, "resumed", ["run.resume=auto"])
    return made


@pytest.fixture
def run(runs, tmp_path, request) -> Path:
    """A private copy of the run named by the test's `base` parameter (default grpo_kl)."""
    name = getattr(request, "param", "grpo_kl")
    return Path(shutil.copytree(runs[name], tmp_path / name))


def _failed(path) -> list[str]:
    return audit_run(path).failed_checks()


# ---- real runs pass ------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*RUNS, "resumed"])
def test_runs_from_the_driver_pass(runs, name):
    report = audit_run(runs[name])
    assert report.ok, report.summary()
    assert report.checks == list(CHECK_NAMES)
    assert report.num_iterations == 3 and report.num_samples == 4 * report.num_groups > 0


def test_the_passing_runs_exercise_the_rules(runs):
    """The passing runs above are not vacuous: one trained errored rewards with the penalty,
    one dropped groups with a reason, one recorded filtered log-probs."""
    assert "filtered_log_probs" in pq.read_table(_iter(runs["rloo_top_k"], 1)).column_names
    metrics = [json.loads(x) for x in (runs["faults"] / "metrics.jsonl").read_text().splitlines()]
    assert metrics[1]["update/attempts"] == 2 and metrics[1]["reward/errors"] > 0
    assert metrics[2]["rollout/failed_calls"] == 1 and metrics[2]["groups/regenerated_samples"] > 0
    files = sorted((runs["penalty"] / "experience").glob("iter_*.parquet"))
    table = pa.concat_tables([pq.read_table(p) for p in files])
    assert "error" in table.column("reward_status").to_pylist()
    ledger = [json.loads(x) for x in (runs["drop"] / "ledger.jsonl").read_text().splitlines()]
    dropped = [r for r in ledger if r["status"] == "dropped"]
    assert dropped and all(r["reason"].startswith("reward error") for r in dropped)


def test_run_resumed_after_a_crash_between_checkpoints(tmp_path, monkeypatch):
    """Iterations after the last checkpoint are redone on resume; their first ledger rows and
    experience must be forgotten, or the ledger records those groups twice."""
    real = driver_module.save_position

    def crash(run_dir, iteration, *args, **kwargs):
        if iteration == 3:   # iteration 2 is written (experience, ledger) but never checkpointed
            raise RuntimeError("injected crash before checkpoint 3")
        return real(run_dir, iteration, *args, **kwargs)
    monkeypatch.setattr(driver_module, "save_position", crash)
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(tmp_path, "crash", ["run.checkpoint_every=2"])
    monkeypatch.setattr(driver_module, "save_position", real)
    report = audit_run(_train(tmp_path, "crash", ["run.checkpoint_every=2", "run.resume=auto"]))
    assert report.ok, report.summary()


# ---- corruptions fail, naming the check ------------------------------------------------------

def _rewrite(path: Path, edit=None, meta_edit=None) -> None:
    """Rewrite an iteration file: edit(columns as Python lists) and/or meta_edit(sealrl meta),
    keeping the schema (types) and the rest of the metadata."""
    old = pq.read_table(path)
    cols = old.to_pydict()
    if edit:
        edit(cols)
    table = pa.table({k: pa.array(v, type=old.schema.field(k).type) for k, v in cols.items()})
    metadata = dict(old.schema.metadata)
    if meta_edit:
        meta = json.loads(metadata[b"sealrl"])
        meta_edit(meta)
        metadata[b"sealrl"] = json.dumps(meta).encode()
    pq.write_table(table.replace_schema_metadata(metadata), path)


def _reseal(path: Path, chain: bool = True) -> None:
    """Seal an edited iteration file again, as a forger would: its digest recomputed over the
    edited facts, so only the checks of what the facts say can catch the edit. `chain`: the
    forger also rewrites the digest where the run committed it (consumed.jsonl, every
    checkpoint's state.json and its checksum); without it the chain check catches the forgery."""
    forged = read_iteration(path, verify=False)._digest()
    _rewrite(path, meta_edit=lambda m: m.update(seal_digest=forged))
    if not chain:
        return
    run, it = path.parent.parent, read_iteration(path).iteration
    consumed = path.parent / "consumed.jsonl"
    rows = [json.loads(x) for x in consumed.read_text().splitlines()]
    consumed.write_text("".join(json.dumps({**r, "seal_digest": forged} if r["iteration"] == it else r) + "\n"
                                for r in rows))
    for folder in (run / "checkpoints").glob("step_*"):
        state = json.loads((folder / "state.json").read_text())
        if str(it) in state.get("sealed", {}):
            state["sealed"][str(it)] = forged
            (folder / "state.json").write_text(json.dumps(state, sort_keys=True, indent=1))
            marker = json.loads((folder / "COMMITTED").read_text())
            marker["files"]["state.json"] = hashlib.sha256((folder / "state.json").read_bytes()).hexdigest()
            (folder / "COMMITTED").write_text(json.dumps(marker, sort_keys=True, indent=1))


def _iter(run: Path, i: int) -> Path:
    return run / "experience" / f"iter_{i:06d}.parquet"


def _ledger(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]


def _write_ledger(run: Path, rows: list[dict]) -> None:
    (run / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sample_duplicated_across_iterations(run):
    row = {k: v[0] for k, v in pq.read_table(_iter(run, 0)).to_pydict().items()}
    _rewrite(_iter(run, 1), lambda c: [c[k].append(row[k]) for k in c])
    report = audit_run(run)
    assert "used_once" in report.failed_checks()
    assert any(v.check == "used_once" and v.sample_id == row["sample_id"] and "trained 2 times" in v.message
               for v in report.violations)


def test_row_removed_from_a_group(run):
    _rewrite(_iter(run, 1), lambda c: [c[k].pop() for k in c])
    report = audit_run(run)
    assert "groups_complete" in report.failed_checks()
    assert any("3 samples" in v.message for v in report.violations if v.check == "groups_complete")


def test_group_mixing_two_prompts(run):
    def mix(c):   # candidate 0 of the first group answers the second group's prompt
        other = c["group_id"].index(next(g for g in c["group_id"] if g != c["group_id"][0]))
        for k in ("prompt_id", "prompt_ids", "prompt_text", "response_ids", "response_text"):
            c[k][0] = c[k][other]
    _rewrite(_iter(run, 1), mix)
    report = audit_run(run)
    assert "groups_complete" in report.failed_checks()
    assert any("mixes prompts" in v.message for v in report.violations)


def test_stale_policy_version(run):
    """Iteration 2 claims iteration 1's version (declared, of this run): the chain breaks."""
    stale = pq.read_table(_iter(run, 1)).column("policy_version")[0].as_py()
    _, stale_json = next(iter(json.loads(pq.read_table(_iter(run, 1)).schema.metadata[b"sealrl"])["versions"].items()))

    def meta(m):
        m["versions"][stale] = stale_json
    _rewrite(_iter(run, 2), lambda c: c.update(policy_version=[stale] * len(c["policy_version"])), meta)
    report = audit_run(run)
    assert "policy_version" in report.failed_checks()
    assert any("committed before this iteration" in v.message for v in report.violations)


def test_mixed_policy_versions(run):
    def edit(c):
        c["policy_version"][0] = c["policy_version"][0].replace("@2.0#", "@1.0#")
    _rewrite(_iter(run, 2), edit)
    assert "policy_version" in _failed(run)


def test_consumed_by_more_steps_than_minibatches(run):
    """consumed_step is outside the seal: only the step arithmetic catches an update that ran
    over the batch more often than actor.ppo_epochs x minibatches."""
    _edit_consumed(run, lambda rows: rows[2].update(consumed_step=rows[2]["consumed_step"] + 5))
    report = audit_run(run)
    assert report.failed_checks() == ["policy_version"]
    assert "6 optimizer steps consumed 16 samples" in report.violations[0].message


@pytest.mark.parametrize("edit, match", [
    (lambda rows: rows.pop(1), "consumed_step is not set"),
    (lambda rows: rows.append(dict(rows[1])), "consumed 2 times"),
    (lambda rows: rows.append({**rows[0], "iteration": 9}), "an iteration with no experience file"),
])
def test_a_consumption_missing_doubled_or_of_nothing(run, edit, match):
    _edit_consumed(run, edit)
    report = audit_run(run)
    assert "used_once" in report.failed_checks()
    assert any(match in v.message for v in report.violations if v.check == "used_once"), report.summary()


def test_an_unreadable_consumption_line(run):
    with open(run / "experience" / "consumed.jsonl", "a") as f:
        f.write("{half a line\n")
    report = audit_run(run)
    assert report.failed_checks() == ["used_once"]
    assert "consumed.jsonl line 4: JSONDecodeError" in report.violations[0].message


def _edit_consumed(run: Path, edit) -> None:
    path = run / "experience" / "consumed.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_mask_of_wrong_length(run):
    def edit(c):
        c["response_mask"][2] = c["response_mask"][2][:-1]
    _rewrite(_iter(run, 0), edit)
    report = audit_run(run)
    assert "masks" in report.failed_checks()
    assert any("response_mask has length" in v.message for v in report.violations)


def test_positive_log_prob(run):
    def edit(c):
        c["rollout_log_probs"][1] = [0.5] + c["rollout_log_probs"][1][1:]
    _rewrite(_iter(run, 0), edit)
    assert "masks" in _failed(run)


def test_old_log_probs_from_the_reference(run):
    def meta(m):
        m["fields"]["old_log_probs"] = dict(m["fields"]["ref_log_probs"])
    _rewrite(_iter(run, 1), meta_edit=meta)
    report = audit_run(run)
    assert "provenance" in report.failed_checks()
    assert any("old_log_probs produced by 'reference'" in v.message for v in report.violations)


@pytest.mark.parametrize("run", ["grpo_kl", "penalty"], indirect=True)
def test_errored_reward_with_a_total(run):
    def edit(c):
        c["reward_status"][0] = "error"          # the total and the score stay
    _rewrite(_iter(run, 0), edit)
    report = audit_run(run)
    assert "rewards" in report.failed_checks()
    assert any("carries a total" in v.message for v in report.violations)


def test_errored_reward_used_as_score(run):
    """drop_group never trains on an errored sample, even one whose record is well formed."""
    def edit(c):
        c["reward_status"][0], c["reward_total"][0] = "timeout", None
    _rewrite(_iter(run, 0), edit)
    report = audit_run(run)
    assert "rewards" in report.failed_checks()
    assert any("reached the loss" in v.message for v in report.violations)


@pytest.mark.parametrize("run", ["penalty"], indirect=True)
def test_errored_reward_scored_other_than_the_penalty(run):
    def edit(c):
        i = c["reward_status"].index("error")
        c["scores"][i] = 1.0
    path = next(p for p in sorted((run / "experience").glob("iter_*.parquet"))
                if "error" in pq.read_table(p).column("reward_status").to_pylist())
    _rewrite(path, edit)
    assert _failed(run) == ["rewards", "derived"]   # the score is also not what the sealed facts give


def test_ledger_row_missing(run):
    _write_ledger(run, _ledger(run)[1:])
    report = audit_run(run)
    assert report.failed_checks() == ["ledger"]
    assert any("no committed ledger row" in v.message for v in report.violations)


@pytest.mark.parametrize("run", ["drop"], indirect=True)
def test_dropped_group_without_reason(run):
    rows = _ledger(run)
    next(r for r in rows if r["status"] == "dropped")["reason"] = ""
    _write_ledger(run, rows)
    report = audit_run(run)
    assert report.failed_checks() == ["ledger"]
    assert any("dropped without a reason" in v.message for v in report.violations)


@pytest.mark.parametrize("run", ["drop"], indirect=True)
def test_dropped_group_missing_from_the_ledger(run):
    """Only the replayed sampler knows that prompt was passed: nothing was trained from it."""
    rows = _ledger(run)
    lost = next(r for r in rows if r["status"] == "dropped")
    _write_ledger(run, [r for r in rows if r is not lost])
    report = audit_run(run)
    assert report.failed_checks() == ["ledger"]
    assert [v.iteration for v in report.violations] == [lost["iteration"]]
    assert "the sampler passed 4 prompts" in report.violations[0].message


def test_replayed_sampler_is_the_drivers():
    from types import SimpleNamespace

    from sealrl.audit.ledger import replay_sampler
    cfg = build_config(None, BASE)
    ours, theirs = replay_sampler(cfg, 10), trainer_setup.build_sampler(cfg, SimpleNamespace(train=range(10)))
    assert [ours.next_batch() for _ in range(7)] == [theirs.next_batch() for _ in range(7)]


def test_trained_group_recorded_as_dropped(run):
    rows = _ledger(run)
    rows[0].update(status="dropped", reason="made up")
    _write_ledger(run, rows)
    report = audit_run(run)
    assert any("recorded as dropped but its samples were trained" in v.message for v in report.violations)


def test_tampered_fact(run):
    def edit(c):
        c["rollout_log_probs"][3] = [x * 0.5 for x in c["rollout_log_probs"][3]]
    _rewrite(_iter(run, 1), edit)
    report = audit_run(run)
    assert report.failed_checks() == ["seal"]
    sample = pq.read_table(_iter(run, 1)).column("sample_id")[3].as_py()
    assert report.violations[0].iteration == 1 and "changed after sealing" in report.violations[0].message
    assert f"changed: row 3 (sample {sample}): rollout_log_probs" in report.violations[0].message


def test_reordered_rows_are_named(run):
    _rewrite(_iter(run, 1), lambda c: [c[k].insert(0, c[k].pop(5)) for k in c])
    report = audit_run(run)
    assert "seal" in report.failed_checks()
    assert "row 0 (sample" in report.violations[0].message and "holds what row 5 held" in report.violations[0].message


@pytest.mark.parametrize("run", ["ppo"], indirect=True)   # GAE: nonzero advantages in every iteration
def test_negated_advantages_are_named_by_row_and_field(run):
    it = next(i for i in range(3) if any(x for row in pq.read_table(_iter(run, i)).column("advantages").to_pylist()
                                         for x in row))
    _rewrite(_iter(run, it), lambda c: c.update(advantages=[[-x for x in row] for row in c["advantages"]]))
    report = audit_run(run)
    assert report.failed_checks() == ["derived"], report.summary()
    v = report.violations[0]
    assert v.iteration == it and "advantages[0] is" in v.message and "the sealed facts give" in v.message


def test_a_file_sealed_again_breaks_the_chain(run):
    _rewrite(_iter(run, 1), lambda c: c.update(reward_total=[None if t is None else 1.0 - t
                                                              for t in c["reward_total"]]))
    _reseal(_iter(run, 1), chain=False)   # sealrl's own digest code, over the edited facts
    report = audit_run(run)
    assert "chain" in report.failed_checks(), report.summary()
    messages = [v.message for v in report.violations if v.check == "chain"]
    assert any("consumed.jsonl committed seal digest" in m for m in messages)
    assert any("checkpoint step_3 committed seal digest" in m for m in messages)


def test_unreadable_file_is_a_violation_not_a_crash(run):
    _iter(run, 2).write_bytes(b"not parquet")
    report = audit_run(run)
    assert "seal" in report.failed_checks()


def test_edited_config(run):
    path = run / "config.yaml"
    path.write_text(path.read_text().replace("reward_error: drop_group", "reward_error: penalty"))
    assert "config" in _failed(run)


# ---- command line ----------------------------------------------------------------------------

def _cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="sealrl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.fn(args)


def test_cli_exit_status_and_summary(run, capsys):
    assert _cli("audit", str(run)) == 0
    out = capsys.readouterr().out
    assert "3 iterations, 48 samples, 12 groups, 12 ledger rows" in out and "all 13 checks passed" in out
    _write_ledger(run, _ledger(run)[1:])
    assert _cli("audit", str(run)) == 1
    out = capsys.readouterr().out
    assert "ledger           2 violation(s)" in out and "[ledger] iteration 0" in out
    assert _cli("audit", str(run), "--json", "--check", "ledger") == 1
    assert json.loads(capsys.readouterr().out)["checks"] == {"ledger": 2}


def test_not_a_run_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.yaml"):
        audit_run(tmp_path)


@pytest.mark.parametrize("run", ["scorers"], indirect=True)
def test_a_reward_no_scorer_process_answered_is_named(run):
    lines = [json.loads(x) for x in (run / "served.jsonl").read_text().splitlines()]
    assert lines and all(set(x) == {"iteration", "scored_by"} for x in lines)
    first = lines[0]
    gone = sorted(first["scored_by"])[0]
    del first["scored_by"][gone]
    (run / "served.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = audit_run(run)
    assert report.failed_checks() == ["scorers"], report.summary()
    assert f"sample {gone}: reward ok but no scorer process answered it" in report.violations[0].message


def test_an_iteration_stopped_during_its_update_is_in_flight_not_a_violation(tmp_path, monkeypatch, run):
    from sealrl.trainer import driver as driver_module
    real = driver_module.update

    def killed_during_update(r, batch, version, it):
        if it == 1:
            raise RuntimeError("the process died during iteration 1's update")
        return real(r, batch, version, it)
    monkeypatch.setattr(driver_module, "update", killed_during_update)
    with pytest.raises(RuntimeError, match="died during"):
        _train(tmp_path, "stopped", ["run.checkpoint_every=1"])
    report = audit_run(tmp_path / "stopped")
    assert report.ok, report.summary()
    assert report.notes and "iterations [1] were sealed but not consumed" in report.notes[0]
    # a consumption missing for an iteration a checkpoint committed stays a violation
    _edit_consumed(run, lambda rows: rows.pop())
    assert "used_once" in audit_run(run).failed_checks()
