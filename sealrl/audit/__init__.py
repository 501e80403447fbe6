"""`sealrl audit RUN_DIR`: check, after the fact, that a run folder proves what sealrl claims
for every trained sample (DESIGN sections 3-4), from the files alone, with no model loaded:

    config           config.yaml still hashes to the hash recorded with it (and in run.json)
    seal             every experience file rebuilds a sealed batch whose digest matches
    used_once        each sample trained once; each iteration consumed once (consumed.jsonl), by
                     a step never before the previous iteration's
    groups_complete  groups of exactly rollout.n candidates 0..n-1 of one prompt, ids consistent
    policy_version   one sampling version per iteration, of this run, committed at most
                     rollout.max_staleness versions before the one its update started from (0:
                     just before it); with partial rollouts, each token's version (token_versions)
                     declared and the oldest within that bound; the update took no more optimizer
                     steps than its minibatches
    masks            token-aligned lists as long as the response; log-probs finite and <= 0
    provenance       each field from a declared producer, at the version it must have
    rewards          errors carry no total and are never a score (except the explicit penalty)
    ledger           every prompt the (replayed) sampler passed was trained or dropped with a
                     reason, never both; no prompt twice in an epoch
    episodes         multi-turn: trained ids == sampled turns + observations; no observation
                     token trained (mask, advantages); per-turn versions, step rewards
    derived          scores, token rewards, advantages and returns equal what the sealed facts
                     give under the run's config (derived again by the driver's own function)
    chain            each file's seal digest is the one consumed.jsonl and every committed
                     checkpoint recorded when the batch was trained (a file sealed again fails)
    scorers          with scorer processes, each trained sample's reward was answered by one of them

    .venv/bin/sealrl audit runs/arith_grpo          # exit status 1 on any violation

This module imports only the standard library; the checks (torch, pyarrow) load on first use.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from sealrl.audit.report import AuditReport, Violation

__all__ = ["AuditReport", "Violation", "audit_run", "add_parser", "CHECK_NAMES"]

CHECK_NAMES = ("config", "seal", "used_once", "groups_complete", "policy_version", "masks",
               "provenance", "rewards", "ledger", "episodes", "derived", "chain", "scorers")


def audit_run(run_dir: str | Path, checks: tuple[str, ...] = CHECK_NAMES) -> AuditReport:
    """Run the named checks on a run folder. Raises FileNotFoundError for a folder that is not
    a run (no config.yaml); everything wrong inside a run is a Violation, never an exception."""
    from sealrl.audit.checks import CHECKS
    from sealrl.audit.folder import load_run
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown audit check(s) {unknown}; available: {', '.join(CHECKS)}")
    run = load_run(run_dir)
    report = AuditReport(str(run_dir), list(checks), num_iterations=len(run.files),
                         num_samples=sum(f.num_rows for f in run.files),
                         num_groups=sum(len(f.groups) for f in run.files), num_ledger_rows=len(run.ledger))
    if run.in_flight:
        report.notes.append(f"iterations {run.in_flight} were sealed but not consumed when the run stopped (no "
                            "checkpoint commits them); resume=auto redoes them; no committed version learned from them")
    for name in checks:
        try:
            report.violations.extend(CHECKS[name](run))
        except Exception as e:  # a folder broken in a way no check foresaw still gets a report
            report.violations.append(Violation(name, f"check could not complete: {type(e).__name__}: {e}"))
    return report


def _main(args: argparse.Namespace) -> int:
    checks = tuple(args.check) if args.check else CHECK_NAMES
    report = audit_run(args.run_dir, checks)
    print(report.to_json() if args.json else report.summary(args.max_listed))
    return 0 if report.ok else 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `sealrl audit` on the CLI's subparsers; its handler is `args.fn(args) -> int`."""
    p = subparsers.add_parser("audit", help="check a run folder's sealed experience and ledger",
                              description="Check that every trained sample of a run is sealed, used once, "
                              "in a complete group, sampled by the version committed just before it (or at most "
                              "rollout.max_staleness versions before it), with "
                              "consistent masks, declared producers, honest rewards and a complete ledger. "
                              "Exit status 1 on any violation.")
    p.add_argument("run_dir", help="runs/<name>")
    p.add_argument("--check", action="append", choices=CHECK_NAMES, help="run only this check (repeatable)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--max-listed", type=int, default=50, help="violations listed in the summary")
    p.set_defaults(fn=_main)
    return p
