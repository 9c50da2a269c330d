"""The import graph: packages import only those below them (``LAYERS``, lowest first), every import counted, also
one inside a function; and no module imports itself back through others at load time (module-level imports)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# lowest first: each package may import the ones before it, never one after it
LAYERS = ["control", "kvtransfer", "kvcache", "engine", "prefill", "decode", "planner", "router", "deploy", "bench", "pdserve"]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: pathlib.Path, top_level_only: bool) -> set[str]:
    """The modules ``name`` imports (of the packages in ``LAYERS``), resolved as far as they are modules."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # ``from pkg import module``
    return {m for m in out if m.split(".")[0] in LAYERS}


def test_packages_import_only_those_below_them():
    wrong = []
    for name, path in modules().items():
        mine = LAYERS.index(name.split(".")[0])
        for other in imports(name, path, top_level_only=False):
            if LAYERS.index(other.split(".")[0]) > mine:
                wrong.append(f"{name} imports {other}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_itself_back_at_load_time():
    known = modules()
    # a module's own parent packages are loaded before it whatever it imports: no edge to them
    graph = {name: {m for m in imports(name, path, top_level_only=True)
                    if m in known and m != name and not name.startswith(m + ".")} for name, path in known.items()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_the_engines_parts_do_not_import_the_engine():
    """``engine.engine`` imports its parts (the pipeline driver, the parallel group, kernels, ...), never the other
    way round; only its users and the entry points of its follower processes import it."""
    users = {"engine.factory", "engine.generate", "engine.parallel.follower", "engine.pipeline.stage"}
    importers = {name for name, path in modules().items()
                 if name.startswith("engine.") and name != "engine.engine"
                 and "engine.engine" in imports(name, path, top_level_only=False)}
    assert importers <= users, sorted(importers - users)
