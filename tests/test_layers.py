"""The package's import graph, read statically (ast; nothing is imported): no cycle between modules, and layers import
one way: engines <- runtime.models <- runtime.stages <- runtime.scheduling <- runtime.tts <- runtime.serving /
runtime.cluster <- build, tools.

Every import counts, wherever it is written: at module level, inside a function (a lazy import) or under
`if TYPE_CHECKING:`. A cycle hidden behind a lazy import is still a cycle: the two modules cannot be understood,
tested or moved apart."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the folders that make up the `cosytrt` package (pyproject's package-dir), and the package's own top-level files
PACKAGE_DIRS = {"build": "build", "engines": "engines", "runtime": "runtime", "tools": "tools"}
TOP_FILES = ("cosytrt/__init__.py", "cosytrt/extras.py")

# (layer, module-name prefixes), bottom first. A module may import its own layer and the layers below it.
# `cosytrt.extras` (optional-import helper) sits with the engines: it imports only `engines.errors`.
# `runtime.errors` re-exports the error types for library users, beside `runtime.tts` (the public entry point).
# `runtime.compat` (the upstream-shaped adapter) wraps TTS, like the server does.
LAYERS = [
    (0, ("cosytrt", "cosytrt.extras", "cosytrt.engines")),
    (1, ("cosytrt.runtime.models",)),
    (2, ("cosytrt.runtime.stages",)),
    (3, ("cosytrt.runtime.scheduling",)),
    (4, ("cosytrt.runtime", "cosytrt.runtime.tts", "cosytrt.runtime.errors")),
    (5, ("cosytrt.runtime.serving", "cosytrt.runtime.cluster", "cosytrt.runtime.compat")),
    (6, ("cosytrt.build", "cosytrt.tools")),
]


def layer_of(module: str) -> int:
    """The layer of the longest prefix that names `module` or one of its parent packages."""
    best, best_len = None, -1
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = layer, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return best


def package_files() -> dict[str, str]:
    """module name -> file path for every module of the package."""
    out = {}
    for rel in TOP_FILES:
        name = "cosytrt" if rel.endswith("__init__.py") else "cosytrt." + os.path.basename(rel)[:-3]
        out[name] = os.path.join(ROOT, rel)
    for pkg, folder in PACKAGE_DIRS.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            parts = ["cosytrt", pkg] + ([] if rel == "." else rel.split(os.sep))
            for f in sorted(filenames):
                if f.endswith(".py"):
                    name = ".".join(parts if f == "__init__.py" else parts + [f[:-3]])
                    out[name] = os.path.join(dirpath, f)
    return out


def imports_of(module: str, path: str, modules: set[str]) -> dict[str, int]:
    """Modules of the package that `module` imports -> the line of the (first) import."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        # `import a.b.c` names the deepest module of the package it reaches
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "cosytrt" or alias.name.startswith("cosytrt."):
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
                if not (source == "cosytrt" or source.startswith("cosytrt.")):
                    continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else source, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    files = package_files()
    names = set(files)
    return {m: imports_of(m, p, names) for m, p in files.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# ---------------------------------------------------------------------------------------------------- the tests

def test_the_walker_sees_the_package():
    graph = import_graph()
    assert len(graph) > 100
    # relative, absolute, lazy (inside a function) and `from pkg import module` imports are all seen
    assert "cosytrt.engines.errors" in graph["cosytrt.runtime.models.llm"]
    assert "cosytrt.runtime.models.rope" in graph["cosytrt.runtime.models.batch_invariant"]
    assert "cosytrt.engines.errors" in graph["cosytrt.extras"]
    assert "cosytrt.runtime.tts" in graph["cosytrt.runtime"]  # lazy, in __getattr__


def test_find_cycles_reports_a_two_module_cycle():
    g = {"a": {"b": 1}, "b": {"a": 2}, "c": {"a": 3}}
    assert find_cycles(g) == [["a", "b"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    lines = []
    for comp in cycles:
        inside = set(comp)
        lines.append(" <-> ".join(comp) + ": " + "; ".join(
            f"{m}:{line} imports {t}" for m in comp for t, line in sorted(graph[m].items()) if t in inside))
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_layers_import_one_way():
    graph = import_graph()
    bad = []
    for m, targets in sorted(graph.items()):
        lm = layer_of(m)
        for t, line in sorted(targets.items()):
            if layer_of(t) > lm:
                bad.append(f"{m}:{line} (layer {lm}) imports {t} (layer {layer_of(t)})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_serving_does_not_import_cluster():
    """The cluster serves the same app over Ray replicas (it may build on runtime.serving); never the reverse."""
    graph = import_graph()
    bad = [f"{m} imports {t}" for m, ts in graph.items() for t in ts
           if m.startswith("cosytrt.runtime.serving") and t.startswith("cosytrt.runtime.cluster")]
    assert not bad, bad
