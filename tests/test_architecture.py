"""The layout's rules, checked on the source: floors, no import cycles, CUDA in one module,
no long files (docs/architecture.md says why)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "memfit"

#: memfit's floors, low to high: a module imports only from its own floor or lower ones. Each
#: name is a module or a package (all its modules) of src/memfit; ``__init__.py`` is the top
#: package's own, the top floor's face. The same list as docs/architecture.md's headings (a
#: test checks it): to move a module to another floor, change both.
FLOORS: list[tuple[str, ...]] = [
    ("errors.py", "units.py", "device.py", "console.py", "versions.py", "outputs.py",
     "extras.py"),
    ("accounting/",),
    ("workload.py", "weights.py", "optim/", "ops/", "targets/", "blocks.py", "techniques.py",
     "stepping.py"),
    ("strategies/", "distributed/"),
    ("plan.py",),
    ("apply/",),
    ("estimate/",),
    ("planner/",),
    ("train/", "integrations/"),
    ("commands/", "cli.py", "bench/", "__main__.py", "__init__.py"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """Every memfit module's memfit imports, wherever they stand (function bodies included:
    a lazy import still makes a cycle, only a later one)."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                # The deepest known module the import names.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("memfit"):
                    graph[name].add(target)
    return graph


def _is_package(name: str) -> bool:
    return (SRC.parent / Path(*name.split(".")) / "__init__.py").exists()


def test_no_import_cycles():
    graph = _imports()
    # A package's __init__ re-exporting its submodules is not a dependency of theirs on it,
    # so edges into a package from its own submodules are the only ones left out.
    edges = {
        a: {b for b in deps if not (_is_package(b) and a.startswith(b + "."))}
        for a, deps in graph.items()
    }
    cycles = []
    for start in edges:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, nxt]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles))[:20])


def test_torch_cuda_only_in_device_module():
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.name != "device.py" and "torch.cuda" in p.read_text()
    ]
    assert offenders == []


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_over_800_lines(path):
    assert len(path.read_text().splitlines()) <= 800


def _floor(module: str) -> int | None:
    """The floor (1 = lowest) of a memfit module, by the file or package it lives in."""
    parts = module.split(".")[1:]
    if not parts:
        name = "__init__.py"
    elif (SRC / parts[0]).is_dir():
        name = parts[0] + "/"
    else:
        name = parts[0] + ".py"
    return next((i for i, names in enumerate(FLOORS, 1) if name in names), None)


def test_every_module_stands_on_a_floor():
    homeless = sorted(m for m in _imports() if _floor(m) is None)
    assert not homeless, (
        "modules on no floor (add their file or package to FLOORS and docs/architecture.md):\n"
        + "\n".join(homeless)
    )


def test_no_import_from_a_higher_floor():
    # Every memfit import, at module level and in function bodies alike: a lazy import that
    # runs up a floor is the same dependency, only later. The fix is to move the shared piece
    # down a floor (or pass it in from above), never an exception here.
    upward = sorted(
        f"{a} -> {b}"
        for a, deps in _imports().items()
        for b in deps
        if None not in (_floor(a), _floor(b)) and _floor(b) > _floor(a)  # type: ignore[operator]
    )
    assert not upward, "imports from a higher floor (docs/architecture.md):\n" + "\n".join(upward)


def test_the_floors_are_the_docs():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    headings = re.findall(r"^### Floor (\d+): (.+)$", doc, flags=re.M)
    documented = [tuple(re.findall(r"`([^`]+)`", names)) for _, names in headings]
    assert [int(n) for n, _ in headings] == list(range(1, len(headings) + 1))
    assert documented == FLOORS


def test_nothing_imports_the_cli_but_main():
    graph = _imports()
    users = sorted(a for a, deps in graph.items() if "memfit.cli" in deps)
    assert users in ([], ["memfit.__main__"])


def test_no_function_over_100_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 100:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], "functions over 100 lines:\n" + "\n".join(long)
