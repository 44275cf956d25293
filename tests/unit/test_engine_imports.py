"""The engine package's imports point one way (issue 11): no circle among its modules (the
static scheduler extends the scheduler, never the reverse), and nothing of the services, gRPC
or Redis. Read from the source with ``ast``; nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "services" / "engine"
PACKAGE = "services.engine"


def engine_imports() -> dict[str, set[str]]:
    """module name -> modules it imports (absolute names), for every file of the package."""
    graph: dict[str, set[str]] = {}
    for path in ENGINE.glob("*.py"):
        name = f"{PACKAGE}.{path.stem}"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = PACKAGE if node.level else ""
                module = f"{base}.{node.module}" if node.module and base else (node.module or base)
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)  # `from . import x`
        graph[name] = found
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
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


def test_the_engine_package_has_no_import_circle():
    graph = engine_imports()
    assert f"{PACKAGE}.scheduler" in graph[f"{PACKAGE}.static_batch"]
    assert find_circle(graph) is None


def test_a_circle_is_found_when_there_is_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_engine_imports_no_service_grpc_or_redis():
    forbidden = ("services.api", "services.state", "services.gateway", "services.prefill",
                 "services.decode", "services.worker", "services.rpc", "grpc", "redis")
    bad = {m: sorted(d for d in deps if d.startswith(forbidden))
           for m, deps in engine_imports().items()}
    assert {m: d for m, d in bad.items() if d} == {}
