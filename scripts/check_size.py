"""The size budget `make lint` enforces: no Python file of the package over 500 lines and no
function over 80 (docs/architecture.md). Prints each offender with its size; exits 1 if any."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def offenders(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            out.append(f"{path}: {lines} lines (budget {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    out.append(f"{path}:{node.lineno}: function {node.name} is {size} lines "
                               f"(budget {MAX_FUNCTION_LINES})")
    return out


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path(__file__).resolve().parents[1] / "sealrl"]
    found = [line for root in roots for line in offenders(root)]
    print("\n".join(found) if found else f"size budget ok: {', '.join(map(str, roots))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
