"""The layout shows the architecture (docs/architecture.md): the import graph, computed from the source, has no cycle
and no forbidden edge.

Every import counts, at the top of a file or inside a function. The rules:
- the runtime (`tinyloop`) imports nothing of the service (`broker`, `workers`) or the tools (`scripts`);
- inside the runtime, layers import down or sideways: facts -> core -> kernels -> models -> engine -> public API;
- `broker` imports no torch, and of the runtime only its torch-free facts (tinyloop.fields and the like);
- `workers` sit above the runtime and the broker, and import no tool;
- no cycle anywhere across the four packages.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from conftest import fresh_interpreter

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("tinyloop", "broker", "workers", "scripts")

# The runtime's layers, lowest first; a module is named by its first part under tinyloop/.
LAYERS = [
    # torch-free facts every room may read: errors, the request-field table, the environment, the mode matrix
    ("facts", {"errors", "fields", "env", "modes"}),
    ("core", {"config", "formats", "tokenizer", "request", "cache", "rotary", "stops", "sampling", "grammar",
              "stream_continuation", "detokenize", "exits"}),
    ("kernels", {"kernels"}),
    ("models", {"model", "models", "memory", "artifact", "hf", "gguf", "loader", "prefix_tree"}),
    ("engine", {"engine"}),
    ("public API", {"generation", "batch", "beam_decode", "handle_base", "prefix", "resume", "speculative", "scoring", "chat",
                    "__init__"}),
]
FACTS = {f"tinyloop.{name}" for name in LAYERS[0][1]} | {"tinyloop"}


def modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four packages (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name `module` imports, relative imports resolved (`from . import x` names x itself)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module] if node.module else
                            package[:len(package) - node.level + 1]) if node.level else node.module
            names |= {f"{base}.{alias.name}" for alias in node.names}  # graph() maps a name back to its module
    return names


def graph(root: Path = REPO) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the project modules it imports, module -> the outside top-level packages it imports)."""
    known = modules(root)
    inside: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for module, path in known.items():
        inside[module], outside[module] = set(), set()
        for name in imported_names(module, path):
            if name.split(".")[0] not in PACKAGES:
                outside[module].add(name.split(".")[0])
                continue
            while name and name not in known:  # `from tinyloop.x import y`: y is a name in module tinyloop.x
                name = name.rpartition(".")[0]
            if name and name != module:
                inside[module].add(name)
    return inside, outside


def layer_of(module: str) -> int:
    name = module.split(".")[1] if "." in module else "__init__"
    for i, (_, names) in enumerate(LAYERS):
        if name in names:
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__} and docs/architecture.md")


def forbidden_edges(inside: dict[str, set[str]], outside: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in inside.items():
        room = module.split(".")[0]
        for target in sorted(targets):
            to = target.split(".")[0]
            if room == "tinyloop" and to != "tinyloop":
                wrong.append(f"{module} -> {target}: the runtime imports nothing of the service or the tools")
            elif room == "tinyloop" and layer_of(target) > layer_of(module):
                wrong.append(f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]}):"
                             " a layer imports only its own and lower ones")
            elif room == "broker" and to == "tinyloop" and target not in FACTS:
                wrong.append(f"{module} -> {target}: the broker reads only the runtime's torch-free facts")
            elif room in ("broker", "workers") and to == "scripts":
                wrong.append(f"{module} -> {target}: the service imports no tool")
            elif room == "broker" and to == "workers":
                wrong.append(f"{module} -> {target}: workers sit above the broker")
    wrong += [f"{m} -> torch: the broker imports no torch" for m, names in outside.items()
              if m.split(".")[0] == "broker" and "torch" in names]
    wrong += [f"{m} -> {sorted(names - set(sys.stdlib_module_names))}: a fact module imports only the standard library"
              for m, names in outside.items() if m in FACTS and names - set(sys.stdlib_module_names)]
    return wrong


def cycles(inside: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(inside.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(inside):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_and_no_forbidden_edge():
    inside, outside = graph()
    assert not cycles(inside), cycles(inside)
    assert not forbidden_edges(inside, outside), "\n".join(forbidden_edges(inside, outside))


def test_the_checks_see_a_cycle_and_a_forbidden_edge(tmp_path):
    """The same checks on a small tree that breaks every rule once (a check that cannot fail proves nothing)."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tinyloop" / "model.py").write_text("from .engine import run\nfrom broker import client\n")
    (tmp_path / "tinyloop" / "engine.py").write_text("def run():\n    from .model import x\n")
    (tmp_path / "broker" / "client.py").write_text("import torch\nfrom tinyloop.model import x\n")
    inside, outside = graph(tmp_path)
    assert [c for c in cycles(inside) if {"tinyloop.engine", "tinyloop.model"} <= set(c)]
    wrong = forbidden_edges(inside, outside)
    assert any("tinyloop.model (models) -> tinyloop.engine (engine)" in w for w in wrong)
    assert any("tinyloop.model -> broker.client" in w for w in wrong)
    assert any("broker.client -> tinyloop.model" in w for w in wrong)
    assert any("broker.client -> torch" in w for w in wrong)


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    return set(fresh_interpreter(f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))").split())


def test_a_generate_call_loads_no_tool_and_no_service_library(fresh_modules):
    loaded = fresh_modules["generate"]  # a fresh interpreter's, after load_model() and a generate call (conftest)
    assert "tinyloop.generation" in loaded  # the call ran
    tops = {name.split(".")[0] for name in loaded}
    assert not tops & {"scripts", "broker", "workers", "click", "uvicorn", "starlette", "matplotlib", "zmq"}, \
        sorted(tops & {"scripts", "broker", "workers", "click", "uvicorn", "starlette", "matplotlib", "zmq"})


@pytest.mark.parametrize("code", ["import tinyloop.fields, tinyloop.env, tinyloop.modes, tinyloop.errors",
                                  "import broker.broker, broker.client, broker.gateway, broker.supervisor"])
def test_facts_and_broker_load_without_torch(code):
    loaded = loaded_after(code)
    assert "torch" not in loaded
    assert {m for m in loaded if m.startswith("tinyloop")} <= FACTS


def test_the_architecture_page_matches_the_tree():
    """docs/architecture.md names every module (a subpackage's files by their folder) and states the layers as
    LAYERS does."""
    page = (REPO / "docs" / "architecture.md").read_text()
    missing = []
    for module, path in modules().items():
        parts = path.relative_to(REPO).parts
        named = f"{parts[1]}/" if len(parts) > 2 else path.name  # tinyloop/kernels/cpu.py -> "kernels/"
        if path.name != "__init__.py" and named not in page:
            missing.append(str(path.relative_to(REPO)))
    assert not missing, f"docs/architecture.md does not name {missing}"
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in page.splitlines() if line.startswith("| ")}
    for layer, names in LAYERS:
        listed = {n.strip(" `/").split(" ")[0] for n in rows[layer].split(",")}
        assert listed == names, (layer, listed ^ names)
