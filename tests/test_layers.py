"""The runtime's modules import one way: core types -> model and cache -> kernels -> engine -> public API.

Every import of a tinyloop module by another (at the top of the file or inside a function) must point to the same
layer or a lower one, and the import graph has no cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

import tinyloop

ROOT = Path(tinyloop.__file__).parent
LAYERS = [
    ("core types", {"errors", "env", "config", "tokenizer", "stops", "sampling", "grammar", "modes", "types", "timing",
                    "continuation"}),
    ("model and cache", {"model", "cache", "memory", "artifact", "hf", "runtime", "prefix_tree",
                         "formats"}),
    ("kernels", {"kernels"}),
    ("engine", {"engine"}),
    ("public API", {"generate", "batch", "decoding", "handles", "prefix", "resume", "speculative", "score", "chat",
                    "bench_engine",
                    "inspect", "train", "bench", "bench_reuse", "bench_peers", "twin", "__init__"}),
]


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    for i, (_, names) in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"tinyloop.{module} belongs to no layer: add it to LAYERS in {__file__}")


def imports() -> dict[str, set[str]]:
    """module -> the tinyloop modules it imports (dotted, relative to the package)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts)
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x
                    found |= {".".join(base + [a.name]) for a in node.names}
                elif target:
                    found.add(target)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinyloop."):
                found.add(node.module[len("tinyloop."):])
            elif isinstance(node, ast.Import):
                found |= {a.name[len("tinyloop."):] for a in node.names if a.name.startswith("tinyloop.")}
        graph[module] = {m for m in found if m and m != module}
    return graph


def test_every_import_points_down_or_sideways():
    wrong = [f"tinyloop.{m} ({LAYERS[layer_of(m)][0]}) imports tinyloop.{t} ({LAYERS[layer_of(t)][0]})"
             for m, targets in imports().items() for t in targets if layer_of(t) > layer_of(m)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = imports()
    resolve = lambda m: m if m in graph else m + ".__init__" if m + ".__init__" in graph else m
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(resolve(t) for t in graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The cycle search finds one when there is one (a test that cannot fail proves nothing)."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("from .a import x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "LAYERS", [("all", {"a", "b"})])
    try:
        test_no_import_cycle()
    except AssertionError as exc:
        assert "a -> b -> a" in str(exc) or "b -> a -> b" in str(exc)
    else:
        raise AssertionError("a two-module cycle was not found")
