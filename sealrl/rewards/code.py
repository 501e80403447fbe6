"""CodeExecutionReward: run the model's Python program on test inputs in the sandbox.

ground_truth: {"tests": [{"stdin": "...", "stdout": "..."}, ...]} (or that dict as a JSON
string). The response's program is the last ```python (or ```py, or bare ```) fenced block, or
the whole answer text when there is no fence. Each test runs the program once in
sealrl.rewards.sandbox.run_sandboxed with the test's stdin; the expected stdout stays in this
process and is compared here, so nothing inside the sandbox can read it. Outputs are compared
after dropping trailing whitespace on every line and trailing blank lines.

Score: the fraction of tests passed (`all_or_nothing=False`, the default), or 1.0 only when every
test passes (`all_or_nothing=True`; it stops at the first failure).

What fails a test and what is an error:
- the *model's* program failing in any way (wrong output, exception, non-zero exit, the CPU,
  memory, process or file limits, the wall-clock deadline, a signal) fails that test: it
  contributes 0 to the score, which is a valid number;
- the *infrastructure* failing (the sandbox refused to run: no namespaces, not root, interpreter
  missing) raises RuntimeError, so the pool records status error for the sample, never a 0;
- an unusable ground truth (no tests, a test without str stdin/stdout) raises ValueError.

Time: each test may take up to `timeout_s` plus ~0.05 s of set-up, so a RewardPool's `timeout_s`
must exceed len(tests) * (timeout_s + 0.1) or the pool will time the sample out first.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sealrl.rewards.base import RewardSample
from sealrl.rewards.sandbox import SandboxStatus, run_sandboxed
from sealrl.rewards.verifiers import DEFAULT_EOS_TEXT, answer_text

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str, eos_text: str = DEFAULT_EOS_TEXT) -> str:
    """The last fenced code block of the response, else the whole answer text."""
    text = answer_text(response, eos_text)
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _normalize(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.strip("\n").splitlines()).rstrip()


def _tests(truth: Any) -> list[dict[str, str]]:
    if isinstance(truth, str):
        truth = json.loads(truth)  # dataset text, not model output
    tests = truth.get("tests") if isinstance(truth, dict) else None
    if not isinstance(tests, list) or not tests or not all(
            isinstance(t, dict) and isinstance(t.get("stdin", ""), str)
            and isinstance(t.get("stdout"), str) for t in tests):
        raise ValueError("code_exec ground_truth needs {'tests': [{'stdin': str, 'stdout': str}, "
                         f"...]}} with at least one test, got {str(truth)[:200]!r}")
    return tests


@dataclass(frozen=True)
class CodeExecutionReward:
    """Fraction of ground-truth tests the response's program passes, run sandboxed (module doc)."""

    name: str = "code_exec"
    version: str = "1"
    timeout_s: float = 5.0
    """Wall-clock limit of each test run (the sandbox's wall_s)."""
    cpu_s: int = 2
    memory_mb: int = 256
    max_processes: int = 8
    all_or_nothing: bool = False
    allow_weak: bool = False
    """Run even where the sandbox cannot isolate fully (sandbox module doc); never in training."""
    eos_text: str = DEFAULT_EOS_TEXT

    def __call__(self, sample: RewardSample) -> float:
        tests = _tests(sample.ground_truth)
        code = extract_code(sample.response, self.eos_text)
        passed = 0
        for test in tests:
            result = run_sandboxed(code, test.get("stdin", ""), cpu_s=self.cpu_s,
                                   wall_s=self.timeout_s, memory_mb=self.memory_mb,
                                   max_processes=self.max_processes, allow_weak=self.allow_weak)
            if result.status is SandboxStatus.REFUSED:
                raise RuntimeError(f"sandbox refused to run: {result.message}")
            ok = result.status is SandboxStatus.OK and not result.stdout_truncated \
                and _normalize(result.stdout) == _normalize(test["stdout"])
            passed += ok
            if self.all_or_nothing and not ok:
                return 0.0
        return passed / len(tests)
