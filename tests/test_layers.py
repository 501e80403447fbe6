"""The package is layered, and the layering is a DAG: a module imports only from its own package,
from a lower floor, or from its floor's packages without a cycle between them. Every import
counts, including those inside functions and under TYPE_CHECKING (docs/architecture.md)."""
from __future__ import annotations

import ast
from pathlib import Path

import sealrl

FLOORS = (
    ("config", "experience", "algos", "models", "data", "obs", "faults", "plugins", "seams"),
    ("rewards", "rollout", "sync", "envs"),
    ("roles",),
    ("placement",),
    ("trainer",),
    ("audit", "cli"),
)
FLOOR = {pkg: i for i, pkgs in enumerate(FLOORS) for pkg in pkgs}
ROOT = Path(sealrl.__file__).parent


def package_of(module: str) -> str:
    """`sealrl.roles.actor` -> `roles`; `sealrl.faults` -> `faults`."""
    return module.split(".")[1]


def imports(path: Path, root: Path = ROOT) -> list[tuple[str, int]]:
    """(imported sealrl module, line) for every import statement in the file."""
    here = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: resolved against this module's package
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((base, node.lineno))
    return [(m, line) for m, line in out if m.startswith("sealrl.")]


def edges(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(importing package, imported package, 'file:line') across packages."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if len(rel.parts) == 2 and rel.name == "__init__.py":
            continue   # the package root itself
        src = package_of(".".join(rel.with_suffix("").parts))
        for module, line in imports(path, root):
            dst = package_of(module)
            if dst != src:
                out.append((src, dst, f"{rel}:{line}"))
    return out


def test_every_package_has_a_floor():
    packages = {package_of(".".join(p.relative_to(ROOT.parent).with_suffix("").parts))
                for p in ROOT.rglob("*.py") if p.relative_to(ROOT.parent).parts[1:] != ("__init__.py",)}
    assert packages - set(FLOOR) == set(), "give every package a floor in FLOORS (and docs/architecture.md)"


def upward_edges(root: Path = ROOT) -> list[str]:
    return [f"{where}: {src} (floor {FLOOR[src]}) imports {dst} (floor {FLOOR[dst]})"
            for src, dst, where in edges(root) if FLOOR[dst] > FLOOR[src]]


def test_no_import_runs_up_a_floor():
    upward = upward_edges()
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_packages_on_one_floor_form_no_cycle():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for src, dst, at in edges():
        if FLOOR[dst] == FLOOR[src]:
            graph.setdefault(src, set()).add(dst)
            where.setdefault((src, dst), at)

    def cycle_from(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = cycle_from(nxt, path + [nxt])
            if found:
                return found
        return None

    for start in sorted(graph):
        loop = cycle_from(start, [start])
        assert loop is None, "import cycle: " + " -> ".join(loop) + " (" + ", ".join(
            where[(a, b)] for a, b in zip(loop, loop[1:])) + ")"


def test_the_checker_sees_an_upward_edge(tmp_path):
    """Negative control: a lazy, relative import of the trainer from a role is found, named by
    file and line."""
    root = tmp_path / "sealrl"
    (root / "roles").mkdir(parents=True)
    (root / "roles" / "probe.py").write_text("import torch\n\n\ndef f():\n    from ..trainer import driver\n")
    assert upward_edges(root) == ["sealrl/roles/probe.py:5: roles (floor 2) imports trainer (floor 4)"]
