"""What an audit found: violations (check, where, what) and the counts of what was looked at.

Plain values only (no torch, no pyarrow), so that the CLI can import it cheaply."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class Violation:
    check: str                      # stable check name, e.g. "groups_complete"
    message: str
    iteration: int | None = None
    group_id: str | None = None
    sample_id: str | None = None

    def where(self) -> str:
        parts = [f"iteration {self.iteration}" if self.iteration is not None else "",
                 f"group {self.group_id}" if self.group_id and not self.sample_id else "",
                 f"sample {self.sample_id}" if self.sample_id else ""]
        return ", ".join(p for p in parts if p) or "run"

    def __str__(self) -> str:
        return f"[{self.check}] {self.where()}: {self.message}"


@dataclass(slots=True)
class AuditReport:
    run_dir: str
    checks: list[str] = field(default_factory=list)        # names of the checks that ran, in order
    violations: list[Violation] = field(default_factory=list)
    num_iterations: int = 0          # experience files
    num_samples: int = 0             # trained rows over all files
    num_groups: int = 0              # trained groups over all files
    num_ledger_rows: int = 0
    notes: list[str] = field(default_factory=list)   # what is not a violation but a reader must know

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_check(self) -> dict[str, int]:
        """Number of violations per check (0 for a clean check)."""
        counts = Counter(v.check for v in self.violations)
        return {name: counts.get(name, 0) for name in self.checks}

    def failed_checks(self) -> list[str]:
        return [name for name, n in self.by_check().items() if n]

    def summary(self, max_listed: int = 50) -> str:
        lines = [f"audit {self.run_dir}: {self.num_iterations} iterations, {self.num_samples} samples, "
                 f"{self.num_groups} groups, {self.num_ledger_rows} ledger rows"]
        for name, n in self.by_check().items():
            lines.append(f"  {name:<16} {'ok' if n == 0 else f'{n} violation(s)'}")
        if self.violations:
            lines.append(f"{len(self.violations)} violation(s):")
            lines += [f"  {v}" for v in self.violations[:max_listed]]
            if len(self.violations) > max_listed:
                lines.append(f"  ... and {len(self.violations) - max_listed} more (--max-listed, --json)")
        else:
            lines.append(f"all {len(self.checks)} checks passed")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"run_dir": self.run_dir, "ok": self.ok, "checks": self.by_check(),
                           "num_iterations": self.num_iterations, "num_samples": self.num_samples,
                           "num_groups": self.num_groups, "num_ledger_rows": self.num_ledger_rows,
                           "violations": [asdict(v) for v in self.violations], "notes": self.notes}, indent=1)
