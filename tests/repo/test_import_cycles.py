"""No import cycle between files of deepinfer/ (the server included) and the serve/ alias, counting
every import statement: module level, inside functions (lazy imports) and under TYPE_CHECKING
alike. A lazy import still makes two files depend on each other; the layering (platforms below
worker below engine) is one-way."""
import ast
from pathlib import Path

from tests.support import REPO as ROOT

PACKAGES = ("deepinfer", "serve")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _resolve(name: str, modules: dict) -> str | None:
    """The file-module an imported dotted name lives in (a name imported from a package's
    __init__ resolves to the package itself)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix
                           for a in node.names]
            for t in targets:
                dep = _resolve(t, modules)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_no_import_cycle_between_files():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (lazy imports count): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_sees_lazy_imports():
    """The checker itself: a cycle made only of function-level imports is reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert find_cycles(graph) == [["a", "b"]]
    g = import_graph()
    # a known lazy edge: the platform picks its kernels from the model's kernel table inside a method
    assert "deepinfer.model_executor.layers.kernel_table" in g["deepinfer.platforms.interface"]


def test_platforms_never_import_worker_or_engine():
    g = import_graph()
    bad = [(m, d) for m, deps in g.items() if m.startswith("deepinfer.platforms")
           for d in deps if d.startswith(("deepinfer.worker", "deepinfer.engine", "deepinfer.entrypoints", "deepinfer.serve"))]
    assert not bad, bad


# -- layering: which package may import which (docs/architecture.md) -------------------------------

RUNTIME = ("deepinfer", "serve")
ABOVE_MODEL = ("deepinfer.worker", "deepinfer.engine", "deepinfer.entrypoints", "deepinfer.platforms",
               "deepinfer.serve", "deepinfer.tools", "deepinfer.cli", "deepinfer.executor", "deepinfer.spec", "serve")
# distributed -> model_executor edges that remain: the step codec encodes the model's step types
# (StepInputs, CompressMeta, Bucket, the prefix-cache copies) for the follower ranks, and the shared Engram tables are filled
# through the loader. Each closes the package circle model_executor -> distributed (collectives,
# groups, layout) -> model_executor; the list may only shrink.
DISTRIBUTED_TO_MODEL_EXCEPTIONS = {
    ("deepinfer.distributed.step_codec", "deepinfer.model_executor.forward_meta"),
    ("deepinfer.distributed.step_codec", "deepinfer.model_executor.static_step"),
    # the prefix-cache copies StepInputs carries (PrefixStateIO, StateCopies): step types like the rest
    ("deepinfer.distributed.step_codec", "deepinfer.model_executor.prefix_state"),
    ("deepinfer.distributed.shared_tables", "deepinfer.model_executor.loader"),
    # the tables it maps are the model's Engram host tables, which sit outside the module tree
    ("deepinfer.distributed.shared_tables", "deepinfer.model_executor.layers.engram_host"),
}


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_model_executor_imports_nothing_above_it():
    g = import_graph()
    bad = [(m, d) for m, deps in g.items() if _in(m, ("deepinfer.model_executor",))
           for d in sorted(deps) if _in(d, ABOVE_MODEL)]
    assert not bad, bad


def test_no_runtime_package_imports_the_tools():
    g = import_graph()
    bad = [(m, d) for m, deps in g.items() if _in(m, RUNTIME) and not _in(m, ("deepinfer.tools",))
           for d in sorted(deps) if _in(d, ("deepinfer.tools",))]
    assert not bad, bad


def test_distributed_and_model_executor_import_each_other_only_through_the_stated_edges():
    g = import_graph()
    back = {(m, d) for m, deps in g.items() if _in(m, ("deepinfer.distributed",))
            for d in deps if _in(d, ("deepinfer.model_executor",))}
    assert back <= DISTRIBUTED_TO_MODEL_EXCEPTIONS, sorted(back - DISTRIBUTED_TO_MODEL_EXCEPTIONS)


def test_layering_checks_see_a_violation():
    """The checks themselves: an upward edge planted in a copy of the graph is found."""
    g = import_graph()
    g["deepinfer.model_executor.shard_plan"] = g["deepinfer.model_executor.shard_plan"] | {"deepinfer.worker.worker"}
    assert [(m, d) for m, deps in g.items() if _in(m, ("deepinfer.model_executor",))
            for d in deps if _in(d, ABOVE_MODEL)] == [("deepinfer.model_executor.shard_plan", "deepinfer.worker.worker")]


def _arrows(graph, sources: tuple[str, ...], targets: tuple[str, ...]) -> list[tuple[str, str]]:
    """Imports from a module of the `sources` packages into one of the `targets` packages."""
    def within(name, packages):
        return any(name == p or name.startswith(p + ".") for p in packages)
    return [(m, d) for m, deps in graph.items() if within(m, sources) for d in deps if within(d, targets)]


def test_spec_worker_and_engine_keep_their_layers():
    """docs/architecture.md §5: spec/ imports neither the worker, the executor nor the engine (it gets the
    runner as an object); the worker never imports the executor (its runner knows only the transport
    protocol) nor the engine; the engine reaches ranks only through the executor."""
    g = import_graph()
    assert not _arrows(g, ("deepinfer.spec",), ("deepinfer.worker", "deepinfer.executor", "deepinfer.engine"))
    assert not _arrows(g, ("deepinfer.worker",), ("deepinfer.executor", "deepinfer.engine"))
    assert not _arrows(g, ("deepinfer.engine",), ("deepinfer.worker", "deepinfer.distributed"))
    # the checker sees the arrows that must exist
    assert _arrows(g, ("deepinfer.engine",), ("deepinfer.executor",))
    assert _arrows(g, ("deepinfer.worker",), ("deepinfer.spec",))
