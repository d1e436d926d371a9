"""The package's shape as a contract: module sizes, the layers every module is held to, what is installed.

The layering is import-linter's (`lint-imports`, run by `make test`; the contract is in pyproject.toml). It
checks the import graph grimp builds from the installed `kvbench`, Hydra's `hydra_plugins` and the checkout's
`scripts`, which holds only the modules of packages found under those folders: the tests here fail when a module
is left out of it, and show that a helper of the methods layer importing the engine is refused.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450
# the task modules came into kvbench/ from a folder of their own, without the limit (RULER's and the custom
# task's generators are longer)
UNLIMITED = ROOT / "kvbench" / "tasks"
ROOTS = ("kvbench", "hydra_plugins", "scripts")  # the contract's root packages


def test_no_module_in_kvbench_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "kvbench").rglob("*.py")
            if UNLIMITED not in p.parents and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_graph_lint_imports_checks_holds_every_module_on_disk():
    """A module missing from the graph (in a folder without __init__.py, or outside the roots) is under no
    contract: lint-imports would keep a contract it never checked."""
    grimp = pytest.importorskip("grimp")
    # what lint-imports builds from its `root_packages`, scanned afresh (grimp's cache can keep modules a folder
    # no longer provides)
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    on_disk = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for root in ROOTS for p in (ROOT / root).rglob("*.py")}
    assert sorted(on_disk - graph.modules) == []


def test_everything_installed_lives_in_kvbench():
    """One folder is the package (code and configs): an editable install is then the checkout on sys.path, and
    the graph above is all of it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"": "."}
    assert setuptools["packages"]["find"]["include"] == ["kvbench*", "hydra_plugins*"]


def test_nothing_at_the_checkout_top_level_takes_an_installed_module_s_name():
    """Python puts the working directory first on sys.path, so a package or module at the checkout's top level
    stands in for an installed one of the same name in every command run from the checkout. A `kernels/` link
    there took the place of Hugging Face's `kernels` (which transformers 5.25 imports when a model module loads):
    `make test` and the README's commands failed at import."""
    import importlib.metadata

    installed = {name for name, dists in importlib.metadata.packages_distributions().items()
                 if any(dist != "kvbench" for dist in dists)}
    importable = {p.stem if p.suffix == ".py" else p.name for p in ROOT.iterdir()
                  if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file())}
    assert "conf" in importable and "tasks" in importable  # the links the layout keeps (docs/architecture.md)
    assert sorted(importable & installed) == []


def test_a_method_helper_that_imports_the_engine_breaks_the_contract(tmp_path):
    """The layers hold for methods/common/ as for a method file: the engine sits above the methods."""
    shutil.copytree(ROOT / "kvbench", tmp_path / "kvbench", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "kvbench" / "methods" / "common" / "probe.py").write_text("import kvbench.engine.session\n")
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                            env={"PATH": str(lint.parent), "PYTHONPATH": str(tmp_path)}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "BROKEN" in result.stdout and "kvbench.methods.common.probe -> kvbench.engine.session" in result.stdout


def test_no_import_cycle_among_kvbench_modules():
    """import-linter's layers contract forbids imports up the layers; this also catches a cycle inside one
    layer (TYPE_CHECKING imports included: grimp counts them), across kvbench, hydra_plugins and scripts."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph(*ROOTS)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph.modules):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
