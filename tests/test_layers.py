"""The package's shape as a contract: module sizes, and what the top-level task and kernel folders import.

The layering of kvbench/ itself is checked by import-linter (`lint-imports`, run by `make test`; the contract
is in pyproject.toml). kvbench.tasks and kvbench.kernels live in their own folders, outside what it scans, so
their imports are checked here: both sit at the bottom, beside kvbench.core.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450


def test_no_module_in_kvbench_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "kvbench").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("folder", ["tasks", "kernels"])
def test_tasks_and_kernels_import_only_the_bottom_layer(folder):
    allowed = ("kvbench.core", f"kvbench.{folder}")
    wrong = []
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("kvbench") and not name.startswith(allowed):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_among_kvbench_modules():
    """import-linter's layers contract forbids imports up the layers; this also catches a cycle inside one
    layer (TYPE_CHECKING imports included: grimp counts them)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("kvbench")
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        # a self-edge is grimp's reading of `import kvbench.conf` (a folder outside kvbench/), not a cycle
        for target in sorted(graph.find_modules_directly_imported_by(module) - {module}):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph.modules):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
