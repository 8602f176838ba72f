"""The runtime package's import direction: no circles (lazy imports count), and each layer imports only the layers
below it. cli sits on top (nothing imports it); ops drives the cluster; serve and train both stand on model and
never on each other; lab stands alone; node (programs run on the nodes) and build (build tools) import no ops.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "runtime" / "shardstack"

# importer layer -> layers it must never import (any module under them, lazily or not)
FORBIDDEN: dict[str, set[str]] = {
    "model": {"train", "serve", "ops", "lab", "cli"},
    "train": {"serve", "ops", "lab", "cli"},
    "serve": {"train", "ops", "lab", "cli"},
    "lab": {"model", "train", "serve", "ops", "cli"},
    "ops": {"serve", "lab", "cli"},
    # Programs that run on the nodes and build tools that run before a deploy: no cluster operations, no CLI.
    "node": {"ops", "serve", "lab", "cli", "build"},
    "build": {"ops", "serve", "train", "lab", "cli", "node"},
    "signing": {"model", "train", "serve", "ops", "lab", "cli", "node", "build"},
    "errors": {"model", "train", "serve", "ops", "lab", "cli"},
    "accel": {"model", "train", "serve", "ops", "lab", "cli"},
}


def module_graph(root: Path) -> dict[str, set[str]]:
    """{module: modules of the same package it imports}, from every import statement wherever it appears."""
    pkg = root.name
    files = {}
    for f in root.rglob("*.py"):
        parts = (pkg, *f.relative_to(root).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, f in files.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join([*here, base] if base else here)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.split(".")[0] == pkg else None
                if target and target != mod and not (is_pkg and target.startswith(mod + ".")):
                    graph[mod].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in graph.items():
        for t in sorted(targets):
            if layer(t) in FORBIDDEN.get(layer(mod), set()):
                bad.append(f"{mod} imports {t}")
            elif layer(t) == "cli" and layer(mod) != "cli" and mod != "shardstack.__main__":
                bad.append(f"{mod} imports {t} (nothing outside the CLI imports it)")
    return bad


def test_the_runtime_package_has_no_import_circles() -> None:
    assert circles(module_graph(PACKAGE)) == []


def test_every_layer_imports_only_what_it_may() -> None:
    assert violations(module_graph(PACKAGE)) == []


def test_the_layers_are_the_packages_that_exist() -> None:
    found = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert found == {"cli", "model", "train", "serve", "ops", "lab", "node", "build", "accel"}


@pytest.fixture
def fake_pkg(tmp_path: Path) -> Path:
    root = tmp_path / "shardstack"
    for sub in ("serve", "train", "cli"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    return root


def test_the_checks_catch_a_lazy_circle_and_a_forbidden_import(fake_pkg: Path) -> None:
    (fake_pkg / "train" / "a.py").write_text("def f():\n    from shardstack.train import b\n")
    (fake_pkg / "train" / "b.py").write_text("from . import a\n")
    (fake_pkg / "serve" / "app.py").write_text("def g():\n    import shardstack.train.a\n")
    (fake_pkg / "train" / "c.py").write_text("from shardstack.cli import main\n")
    graph = module_graph(fake_pkg)
    assert circles(graph) == [["shardstack.train.a", "shardstack.train.b"]]
    assert violations(graph) == ["shardstack.serve.app imports shardstack.train.a",
                                 "shardstack.train.c imports shardstack.cli"]
