"""The whole tree's imports point one way (issue 11, docs/architecture.md): no circle among the
modules of services/, kernels/ and loadtest/; kernels imports nothing of services; the gateway
reaches no model, engine, kernel or worker-runtime module. Read from the source with ``ast``
(module-level imports only: what runs at import time; ``if TYPE_CHECKING:`` blocks and imports
inside functions are deliberate late binding and are left out)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "kernels", "loadtest")

# the gateway needs the tokenizer, the chat template and the text side of sampling, never these
GATEWAY_FORBIDDEN = ("torch", "kernels", "services.runtime.worker", "services.engine.engine",
                     "services.engine.model", "services.engine.model_runner",
                     "services.engine.scheduler", "services.engine.engine_loop",
                     "services.engine.loader", "services.engine.quantized",
                     "services.kv_transfer", "services.decode", "services.prefill")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module, package: str) -> set[str]:
    found: set[str] = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and not _is_type_checking(node):
            stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
            stack += [n for h in node.handlers for n in h.body]
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> modules of the tree it imports at import time (plus outside names as given)."""
    graph: dict[str, set[str]] = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            name = module_name(path)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            graph[name] = _top_level_imports(ast.parse(path.read_text()), package)
    for name, deps in graph.items():  # importing a.b.c runs a/__init__ and a/b/__init__ too,
        own = _ancestors(name)            # but a module's own packages are already running
        for dep in list(deps):
            deps.update(_ancestors(dep) - own)
        deps.discard(name)
    return graph


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle among the graph's own modules, as a path that ends where it starts."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node] & graph.keys()):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep, path + [dep])):
                return circle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start, [start])):
            return circle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for dep in graph.get(node, ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_import_circle_in_the_tree():
    graph = import_graph()
    assert "services.gateway.pipeline" in graph and "kernels.quant" in graph
    # static batching extends the continuous scheduler, never the reverse
    assert "services.engine.scheduler" in graph["services.engine.static_batch"]
    assert "services.engine.static_batch" not in graph["services.engine.scheduler"]
    assert find_circle(graph) is None


def test_a_circle_is_found_when_there_is_one():
    graph = {"a": {"b"}, "b": {"c", "os"}, "c": {"a"}, "d": set()}
    assert find_circle(graph) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_the_gateway_reaches_no_model_engine_kernel_or_worker_runtime():
    graph = import_graph()
    gateway = {m for m in graph if m.startswith("services.gateway")}
    assert "services.gateway.app" in gateway
    for module in sorted(gateway):
        bad = sorted(d for d in reachable(graph, module)
                     if any(d == f or d.startswith(f + ".") for f in GATEWAY_FORBIDDEN))
        assert not bad, f"{module} reaches {bad}"


def test_the_forbidden_reach_is_detected():
    graph = {"services.gateway.x": {"services.engine.tokenizer"},
             "services.engine.tokenizer": {"services.engine.loader"},
             "services.engine.loader": {"torch"}}
    assert "torch" in reachable(graph, "services.gateway.x")


def test_kernels_import_nothing_of_services_and_the_engine_no_service():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("kernels"):
            assert not [d for d in deps if d.startswith("services")], module
        if module.startswith("services.engine"):
            bad = [d for d in deps if d.split(".")[0] in ("grpc", "redis") or d.startswith(
                ("services.gateway", "services.decode", "services.prefill", "services.state",
                 "services.kv_transfer", "services.runtime.worker", "services.rpc"))]
            assert not bad, f"{module} imports {bad}"
