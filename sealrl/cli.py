"""Command line: `sealrl train CONFIG [section.key=value ...]` and `sealrl eval PATH`.

User errors (sealrl.config.UserError and its subclasses: ConfigError, MissingInputError,
DatasetError, DataFileError, CheckpointError, ...: a wrong config value, a missing or bad
file, an unknown key, a refused resume) end with one line on stderr and exit status 2. Any
other exception is a bug: its full traceback is printed and the exit status is 1."""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from pathlib import Path

# How long an idle OpenMP thread of torch's pool spins before it sleeps (GNU OpenMP, which the
# CPU torch uses). Its default, about 3 ms, is ruinous when a core is shared: another busy
# process made a step 10x slower on 2 cores. Sleeping at once (OMP_WAIT_POLICY=PASSIVE, this
# CLI's choice until session 17) makes every small op wait for its threads to wake: the embedded
# model's step took twice as long as with spinning on an idle machine, the mid shape's 1.15x
# (docs/design-notes.md, "CPU threads"). 3,000 spins (about 30 us) keeps nearly all the gain and
# bounds the loss when a core is shared. A user's own setting wins. Set before torch is imported.
SPIN_COUNT = "3000"
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT

def _train(args) -> int:
    from sealrl.config import load_config
    overrides = list(args.overrides)
    resume = [o for o in overrides if o.startswith("resume=")]
    overrides = [o for o in overrides if not o.startswith("resume=")]
    overrides += [f"run.{o}" for o in resume]   # `resume=auto` is shorthand for run.resume=auto
    seen: dict[str, str] = {}
    for item in overrides:   # the last would silently win: a typo'd script says which it meant
        key = item.partition("=")[0]
        if key in seen:
            from sealrl.config import ConfigError
            raise ConfigError(f"override {key} is given twice ({seen[key]} and {item}); give it once")
        seen[key] = item
    cfg = load_config(args.config, overrides)   # before heavy imports: a bad key fails fast
    from sealrl.trainer.inputs import check_inputs
    check_inputs(cfg)                            # model folder and data files, before torch
    from sealrl.trainer.driver import train
    summary = train(cfg)
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    if before is not None and after is not None:
        print(f"held-out accuracy: {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points) "
              f"after {summary['iterations']} iterations, {summary['wall_s']:.0f} s of training; "
              f"run folder {summary['run_dir']}")
    print(json.dumps({k: summary[k] for k in ("accuracy_before", "accuracy_after", "wall_s", "iterations")}))
    if summary["stopped_by"]:   # SIGTERM / SIGINT: a requested stop at a checkpoint (trainer/stopping.py)
        print(f"sealrl: stopped by {summary['stopped_by']} after {summary['iterations']} of {cfg.run.iterations} "
              f"iterations, checkpoint step_{summary['iterations']} committed; resume=auto continues "
              f"(exit status {summary['exit_status']})", file=sys.stderr)
        return summary["exit_status"]
    if not summary["completed"]:   # the user's wall cap: a clean stop at a checkpoint, not a failure
        print(f"sealrl: stopped at the wall cap (run.max_wall_s={cfg.run.max_wall_s:g}) after "
              f"{summary['iterations']} of {cfg.run.iterations} iterations, checkpoint committed; "
              f"resume=auto continues", file=sys.stderr)
    return 0


def _eval(args) -> int:
    from sealrl.config import MissingInputError, load_config
    from sealrl.trainer.offline.eval_cli import evaluate_path
    path = Path(args.path)
    if not path.exists():
        raise MissingInputError(f"{path} does not exist")
    run_cfg = next((p / "config.yaml" for p in (path, path.parent, path.parent.parent)
                    if (p / "config.yaml").is_file()), None)
    cfg = load_config(str(run_cfg) if run_cfg else args.config, args.overrides, check_run=False)
    out = evaluate_path(path, cfg, num=args.num, pass_k=args.pass_k)
    print(json.dumps(out))
    return 0


def _quiet_libraries() -> None:
    """Our own progress bar is the only one: no per-load/per-save bars from transformers."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sealrl", description="RL post-training with a sealed, "
                                     "versioned experience record.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy", description="Train from a YAML config; "
                       "dotted overrides such as rollout.n=8 actor.lr=1e-5 change single keys; "
                       "resume=auto continues from the last committed checkpoint.")
    t.add_argument("config", help="YAML config file (see examples/)")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides, or resume=auto")
    t.set_defaults(fn=_train)
    e = sub.add_parser("eval", help="held-out accuracy and pass@k of a run, checkpoint or model folder",
                       description="Evaluate a run folder (its final model, else its latest checkpoint), "
                       "a checkpoint folder, or a Hugging Face model folder on the held-out problems.")
    e.add_argument("path", help="runs/<name>, runs/<name>/checkpoints/step_N, or a model folder")
    e.add_argument("--config", default=None, help="config for a bare model folder (task, max tokens)")
    e.add_argument("--num", type=int, default=None, help="number of held-out problems (default: eval.num)")
    e.add_argument("--pass-k", type=int, default=1, help="also report pass@k with k samples")
    e.add_argument("overrides", nargs="*", help="section.key=value overrides")
    e.set_defaults(fn=_eval)
    from sealrl.audit import add_parser as add_audit
    from sealrl.obs.report import add_parser as add_report
    from sealrl.trainer.offline.recompute import add_parser as add_recompute
    from sealrl.trainer.offline.replay import add_parser as add_replay
    for add in (add_audit, add_report, add_recompute, add_replay):
        add(sub)
    args = parser.parse_args(argv)
    from sealrl.config import UserError
    try:
        _quiet_libraries()
        return args.fn(args)
    except KeyboardInterrupt:   # a second SIGINT/SIGTERM during training, or Ctrl-C elsewhere
        kept = "; nothing after the last committed checkpoint was kept" if args.fn is _train else ""
        print(f"sealrl: interrupted{kept}", file=sys.stderr)
        return 130
    except UserError as e:
        print(f"sealrl: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            return _internal_error()
        print(f"sealrl: error: disk full writing {e.filename or 'the run folder'} ({e.strerror}); nothing "
              "after the last committed checkpoint is kept: free space, then resume=auto continues from it",
              file=sys.stderr)
        return 2
    except Exception:
        return _internal_error()


def _internal_error() -> int:
    """A bug, not the user's input: keep everything needed to find it."""
    traceback.print_exc()
    print("sealrl: internal error (the traceback above); please report it", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
