"""`sealrl replay RUN_DIR`: train a finished run again following the schedule its record holds
(which policy version sampled each iteration) and check that the replay reproduces it bitwise:
every iteration's sealed facts (the seal digest) and the final weights hash.

The schedule comes from the record alone: each iteration's sealed `policy_version` (one per
iteration: the version each response started from) and `experience/consumed.jsonl` (the
step each iteration's update started from: 0 for iteration 0, else the step iteration i-1's
update committed). Iteration i sampled by the version of step s is sampled, in the replay, by
the version consuming iteration source(i) = the latest j <= i whose update started from step s
(trainer/pipeline.py `Pipeline.source`). A schedule can be followed when that j exists (a
version committed by then, never a later one) and i - j <= rollout.max_staleness (the versions
the rollout retains); anything else is a ScheduleError naming the iteration. A replay that
seals other facts than the record, or ends on other weights, is a ReplayMismatch naming the
first iteration that differs.

Partial rollouts (rollout.partial=switch): each token's version is sealed (`token_versions`);
the iteration's samples, all from one generate call, switch at the same tokens, and the replay
generates that call again switching at those tokens to the recorded versions (waiting for each
to be published), so its tokens and log-probs are the record's. Samples of one iteration that
switch at different tokens (a retried call) are a ScheduleError.

The replayed run goes to OUT/<run.name> (default OUT = RUN_DIR/replay); run it from the
working directory of the original run (relative paths in its config.yaml are resolved there).
"""
from __future__ import annotations

import json
from pathlib import Path

from sealrl.config import MissingInputError, UserError, load_config
from sealrl.experience.store import iteration_path, read_consumed, read_iteration
from sealrl.trainer.variants.partial import recorded_plan


class ScheduleError(UserError):
    """The recorded schedule is one the pipeline cannot follow (or cannot be read)."""


class ReplayMismatch(UserError):
    """The replay did not reproduce the run: other sealed facts or other final weights."""


def recorded_schedule(run_dir: Path, iterations: int, bound: int) -> "RecordedSchedule":
    """iteration i -> source(i), the iteration whose consuming version sampled i (and the
    switches of partial rollouts), from the sealed records and consumed.jsonl of `run_dir`;
    ScheduleError when it cannot be followed."""
    folder = Path(run_dir) / "experience"
    consumed, errors = read_consumed(folder)
    if errors:
        raise ScheduleError(f"{folder / 'consumed.jsonl'}: {errors[0]}")
    started, schedule = [], RecordedSchedule()   # started[j]: the step iteration j's update started from
    for i in range(iterations):
        path = iteration_path(folder, i)
        if not path.is_file():
            raise ScheduleError(f"iteration {i}: no sealed record ({path})")
        batch = read_iteration(path)   # raises when the facts do not match their seal
        ids = sorted({s.policy_version for s in batch.samples})
        if len(ids) != 1:
            raise ScheduleError(f"iteration {i}: sampled by {len(ids)} versions {ids}; "
                                "replay follows one per iteration")
        lines = consumed.get(i - 1, []) if i else [{"consumed_step": 0}]
        if len(lines) != 1:
            raise ScheduleError(f"iteration {i}: the step its update started from is not recorded "
                                f"({len(lines)} lines for iteration {i - 1} in consumed.jsonl)")
        started.append(lines[0]["consumed_step"])
        step = batch.versions[ids[0]].step
        sources = [j for j in range(i + 1) if started[j] == step]
        if not sources:
            raise ScheduleError(f"iteration {i}: sampled by {ids[0]} (step {step}), which no update up to "
                                f"iteration {i} started from (steps {started}): not a version the pipeline held")
        if i - sources[-1] > bound:
            raise ScheduleError(f"iteration {i}: sampled by {ids[0]}, the version of iteration {sources[-1]}, "
                                f"{i - sources[-1]} iterations behind: beyond rollout.max_staleness={bound}")
        schedule[i] = sources[-1]
        _switches(schedule, i, batch, started, step)
    return schedule


class RecordedSchedule(dict):
    """iteration -> source iteration, and `switches`: iteration -> {first token: the iteration
    whose consuming version sampled from that token on} (partial rollouts, trainer/variants/partial.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.switches: dict[int, dict[int, int]] = {}
        self.targets: dict[int, dict] = {}   # iteration -> {first token: the recorded PolicyVersion}


def _switches(schedule: RecordedSchedule, i: int, batch, started: list[int], step: int) -> None:
    """Iteration i's recorded switch points, each to a version some update up to i started from."""
    try:
        plan = recorded_plan(batch)
    except ValueError as e:
        raise ScheduleError(f"iteration {i}: {e}; replay follows one switch schedule per iteration") from None
    if batch.has("token_versions"):
        schedule.switches[i], schedule.targets[i] = {}, {}
    by_step = {v.step: v for v in batch.versions.values()}
    for token, to in plan.items():
        later = [j for j in range(i + 1) if started[j] == to]
        if to <= step or not later:
            raise ScheduleError(f"iteration {i}: switches at token {token} to step {to}, which is not a version "
                                f"published after its start (step {step}) by iteration {i} (steps {started})")
        schedule.switches[i][token] = later[0]
        schedule.targets[i][token] = by_step[to]


def replay(run_dir: str | Path, out: str | Path | None = None) -> dict:
    """Replay the finished run in `run_dir` into `out`/<run.name>; returns what was compared."""
    from sealrl.trainer.driver import train
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file() or not (run_dir / "config.yaml").is_file():
        raise MissingInputError(f"{run_dir}: not a finished run folder (no summary.json or config.yaml)")
    recorded = json.loads((run_dir / "summary.json").read_text())
    if not recorded.get("completed"):
        raise ScheduleError(f"{run_dir}: the run stopped before run.iterations (completed: false); "
                            "replay follows finished runs (resume=auto finishes it)")
    out = Path(out) if out is not None else run_dir / "replay"
    cfg = load_config(str(run_dir / "config.yaml"), [f"run.output_dir={out}", "run.resume=never", "run.max_wall_s=0"])
    if (out / cfg.run.name).exists():
        raise UserError(f"{out / cfg.run.name} exists: remove it or pass another --out")
    schedule = recorded_schedule(run_dir, recorded["iterations"], cfg.rollout.max_staleness)
    summary = train(cfg, schedule)
    replayed = Path(summary["run_dir"])
    for i in range(recorded["iterations"]):
        want, got = (read_iteration(iteration_path(r / "experience", i)) for r in (run_dir, replayed))
        if got.seal_digest != want.seal_digest:
            raise ReplayMismatch(f"iteration {i}: the replay sealed other facts than {run_dir} (digest "
                                 f"{got.seal_digest[:12]} != {want.seal_digest[:12]}; sampled by "
                                 f"{got.samples[0].policy_version}, recorded {want.samples[0].policy_version})")
    if summary["weights_hash"] != recorded["weights_hash"]:
        raise ReplayMismatch(f"final weights {summary['weights_hash'][:12]} != recorded "
                             f"{recorded['weights_hash'][:12]}")
    result = {"run_dir": str(run_dir), "replay_dir": str(replayed), "iterations": recorded["iterations"],
              "lag": [i - j for i, j in sorted(schedule.items())], "weights_hash": summary["weights_hash"],
              "bitwise": True}
    (replayed / "replay.json").write_text(json.dumps(result, indent=1))
    return result


def add_parser(subparsers) -> None:
    """Register `sealrl replay RUN_DIR [--out DIR]`."""
    p = subparsers.add_parser(
        "replay", help="train a finished run again from its recorded schedule; check it is reproduced bitwise",
        description="Read which policy version sampled each iteration from RUN_DIR's sealed records, train "
                    "the run again following that schedule into OUT/<run.name> (default OUT = RUN_DIR/replay), "
                    "and check every iteration's sealed facts and the final weights hash against the record.")
    p.add_argument("run_dir", help="runs/<name>")
    p.add_argument("--out", default=None, help="output folder of the replay (default: RUN_DIR/replay)")
    p.set_defaults(fn=_run)


def _run(args) -> int:
    print(json.dumps(replay(args.run_dir, args.out)))
    return 0
