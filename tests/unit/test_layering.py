"""The dependency rule (docs/architecture.md): api <- runtime <- operator <- cli, tfps.api free
of TensorFlow, grpcio, kopf and kubernetes, the runtime free of kopf and kubernetes, the
operator free of TensorFlow, and no import cycle among tfps's modules. Read from the source
with ast, every import counted, lazy ones inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"api": "tfps.api", "runtime": "tfps.runtime", "operator": "tfps.operator", "cli": "tfps.cli"}
LAYER = {"tfps.api": 0, "tfps.runtime": 1, "tfps.operator": 2, "tfps.cli": 3}
FORBIDDEN = {
    "tfps.api": ("tensorflow", "grpc", "grpc_health", "kopf", "kubernetes", "numpy"),
    "tfps.runtime": ("kopf", "kubernetes"),
    "tfps.operator": ("tensorflow",),
}


def _modules() -> dict[str, set[str]]:
    """tfps module -> the modules it imports (absolute names)."""
    graph = {}
    for folder, package in PACKAGES.items():
        for path in sorted((REPO / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            imports = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imports |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        base = ".".join(package.split(".")[: 3 - node.level]) + (f".{base}" if base else "")
                    imports.add(base)
                    imports |= {f"{base}.{a.name}" for a in node.names}
            graph[name] = imports
    return graph


GRAPH = _modules()


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_follow_the_dependency_rule(module):
    package = ".".join(module.split(".")[:2])
    for imported in GRAPH[module]:
        top = imported.split(".")[0]
        assert top not in FORBIDDEN.get(package, ()), f"{module} imports {imported}"
        target = ".".join(imported.split(".")[:2])
        if target in LAYER:
            assert LAYER[target] <= LAYER[package], f"{module} imports {imported}, a layer above it"


def test_no_import_cycle():
    edges = {m: {i for i in imports if i in GRAPH and i != m} for m, imports in GRAPH.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done:
            return
        for other in edges[module]:
            visit(other, path + [module])
        done.add(module)

    for module in edges:
        visit(module, [])


def test_the_operator_image_has_every_module_the_operator_imports():
    """images/operator installs only the `operator` extra: no grpcio, no TensorFlow, no numpy
    extras of the runtime's. Every module the operator reaches, lazily or not, must do without."""
    reached, todo = set(), [m for m in GRAPH if m.startswith("tfps.operator")]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo += [i for i in GRAPH[module] if i in GRAPH]
    for module in sorted(reached):
        tops = {i.split(".")[0] for i in GRAPH[module]}
        assert not tops & {"grpc", "grpc_health", "tensorflow", "sklearn", "ml_dtypes"}, (module, tops)


def test_the_ps_process_loads_neither_tensorflow_nor_protobuf():
    """A PS's memory beyond its shard is a goal (PS peak RSS ≤ 1.3× parameters + slots): the
    modules `tfps ps` loads, lazy ones included, leave out TensorFlow and protobuf (its health
    service speaks its two messages itself, runtime/health.py)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tfps.runtime import ps_main\n"
        "from tfps.runtime import auth, metrics, models, ps, sharding\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'google', 'grpc_health'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout.split()
    # grpc's own __init__ imports the (empty) grpc_health namespace package, not its protobuf messages
    assert set(out) <= {"grpc_health"}, out


def test_test_modules_have_names_of_their_own():
    """pytest imports the tiers' test modules by basename (the tiers are not packages): two
    modules of one name stop the collection of the whole suite."""
    seen: dict[str, Path] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name"
        seen[path.name] = path
