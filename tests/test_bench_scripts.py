"""scripts/ as entry points over the package: no script edits sys.path or imports another (their shared code is
`kvbench.bench` and `kvbench.devtools`), every script is run by a test, and CPU smoke runs of the measurement
scripts no other test runs (tiny models, a step or two: they check that the scripts still run, not their numbers).
The GPU session's scripts are run by tests/test_gpu_scripts.py."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbench.results.store import RecordStore, point_hash

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
NUMBER = r"\d+\.\d+"


def script(name: str, *args: str, timeout: int = 240) -> str:
    """`python scripts/NAME ARGS` as a user runs it (from the checkout, offline): its stdout; it must exit 0."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def imports_of(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a file, those inside functions included (most scripts import lazily)."""
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_no_script_edits_sys_path_or_imports_another():
    """`python scripts/X.py` puts scripts/ on sys.path: an import of a sibling would work there and nowhere else
    (and the import contract would not see it: grimp takes it for an outside package)."""
    names = {p.stem for p in SCRIPTS.glob("*.py")}
    for path in sorted(SCRIPTS.glob("*.py")):
        assert "sys.path.insert" not in path.read_text() and "sys.path.append" not in path.read_text(), path.name
        for node in imports_of(path):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not {m.split(".")[0] for m in modules} & (names | {"scripts"}), (path.name, node.lineno)


def test_every_name_a_script_imports_from_kvbench_exists():
    """A renamed function of kvbench breaks the script that imports it here, on the CPU, and not first on a lent
    GPU (scripts import lazily, inside the functions a GPU run reaches)."""
    for path in sorted(SCRIPTS.glob("*.py")):
        for node in imports_of(path):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("kvbench", "hydra_plugins"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                        f"{path.name}:{node.lineno}: {node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "kvbench":
                        assert importlib.util.find_spec(alias.name), f"{path.name}:{node.lineno}: {alias.name}"


def test_every_script_is_run_by_a_test():
    tests = "\n".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    unnamed = [p.name for p in sorted(SCRIPTS.iterdir()) if p.is_file() and p.stem not in tests]
    assert not unnamed, f"scripts no test names: {unnamed}"


def test_decode_attention_bench_times_the_kernel_against_the_stream_floor():
    out = script("bench_decode_attention.py", "--device", "cpu", "--dtype", "float32", "--rows", "16,32",
                 "--kv-heads", "2", "--group", "2", "--head-dim", "16", "--layers", "2", "--repeats", "2")
    assert re.search(rf"^decode attention on cpu, torch.float32, .* stream rate {NUMBER} GB/s$", out, re.M), out
    for rows in (16, 32):
        assert re.search(rf"^\s+{rows}\s+{NUMBER}\s+\d+\s+\d+\s+{NUMBER}\s+\d+\s+{NUMBER}$", out, re.M), out
    assert out.count("SDPA enable_gqa") == 2


def test_eager_floor_bench_times_the_hand_written_step():
    out = script("bench_eager_floor.py", "--model", "tiny_llama", "--rows", "16", "--steps", "2", "--rounds", "1")
    assert re.search(rf"^tiny_llama, .* 16 cached rows per KV head: eager step without the harness {NUMBER} "
                     rf"ms/token, gemv floor {NUMBER} ms, ratio {NUMBER}$", out, re.M), out


def test_ragged_decode_bench_times_the_cache_alone_and_both_methods():
    out = script("bench_ragged_decode.py", "--model", "tiny_llama", "--length", "128", "--budget", "64",
                 "--steps", "2", "--warmup", "1", "--cache-lengths", "64")
    assert re.search(rf"^\s+64(\s+{NUMBER}){{5}}$", out, re.M), out
    for method in ("snapkv", "adakv"):
        assert re.search(rf"^{method}\s+{NUMBER} ms/token \(p90 {NUMBER}\), \d+ tokens kept", out, re.M), out
    assert re.search(rf"^ragged / dense decode per token: {NUMBER}", out, re.M), out


def test_blockwise_memory_bench_measures_the_three_prefills():
    out = script("bench_blockwise_memory.py", "--model", "tiny_llama", "--length", "300", "--budget", "32",
                 "--block", "16", "--decode", "2")
    rows = re.findall(rf"^(dense prefill|one-shot KeyDiff|block-wise KeyDiff).*?\s+(\d+)\s+{NUMBER}$", out, re.M)
    assert [label for label, _ in rows] == ["dense prefill", "one-shot KeyDiff", "block-wise KeyDiff"], out
    assert int(rows[2][1]) < int(rows[0][1])  # block-wise eviction holds fewer entries per head at its peak


def test_dtype_bench_times_both_dtypes():
    out = script("bench_dtype.py", "--model", "tiny_llama", "--length", "32", "--steps", "2", "--repeats", "1")
    for dtype in ("float32", "bfloat16"):
        assert re.search(rf"^{dtype}\s+prefill\s+{NUMBER} s\s+decode\s+{NUMBER} ms/token$", out, re.M), out
    assert re.search(rf"^fp32 / bf16: prefill {NUMBER}x, decode {NUMBER}x$", out, re.M), out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_harness_overhead_bench_compares_kvbench_with_the_bare_model(dtype):
    """bfloat16: on a CPU that multiplies it natively the model's weights are blocked (`pack_linear_weights`),
    which a stock copy of the model could not load: the bare loop runs the same model object."""
    out = script("bench_harness_overhead.py", "--model", "tiny_llama", "--dtype", dtype, "--seq-len", "1100",
                 "--samples", "1")
    assert out.startswith(f"tiny_llama, torch.{dtype}, 1 RULER niah_single_1 samples"), out
    for name in ("kvbench \\(no NLL\\)", "kvbench \\(with NLL\\)", "bare model"):
        assert re.search(rf"^{name}\s+{NUMBER} s\s+{NUMBER}x bare$", out, re.M), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it times every kernel: the GPU session runs it")
def test_kernel_bench_says_it_needs_a_gpu():
    """The Triton kernels are timed on CUDA only; the names it imports are checked above."""
    out = script("bench_kernels.py", "--dtype", "fp32")
    assert out.startswith("no GPU: the Triton kernels are benchmarked on CUDA only"), out


def test_load_memory_bench_loads_both_ways_in_fresh_processes():
    out = script("bench_load_memory.py", "--hidden", "128", "--layers", "1", "--shard-mb", "10", "--repeats", "1")
    for way in ("move", "device_map"):
        assert re.search(rf"^\s*{way}: peak host memory staged by the load\s+\d+ MiB", out, re.M), out
    assert re.search(rf"^load-then-move / device_map peak: {NUMBER}x$", out, re.M), out


def write_point(root: Path, method: str, budget: int | None, scores: list[float]) -> None:
    """A run directory of a method x budget sweep, its records carrying RocketKV Table 1's columns."""
    point = {"model": "tiny", "task": "niah", "method": method, "budget": budget, "seq_len": 256,
             "compress_question": False}
    store = RecordStore(root / "tiny" / "niah" / f"{method}_{budget}")
    for i, score in enumerate(scores):
        store.append({"sample_id": f"s{i}", "task": "niah", "score": score, "nll": 1.0 + i,
                      "turns": [{"prediction": "p", "score": score}], "point": point, "point_hash": point_hash(point),
                      "storage_ratio_bytes": 0.25, "storage_ratio_table1": 0.25,
                      "decode_read_tokens_per_group": budget or 256, "budget_plan": {"sequence_length": 256}})


def test_budget_tables_prints_the_accuracy_and_table1_columns(tmp_path):
    write_point(tmp_path, "full", None, [1.0, 1.0])
    for budget, scores in ((32, [0.0, 1.0]), (64, [1.0, 1.0])):
        write_point(tmp_path, "snapkv", budget, scores)
    out = script("budget_tables.py", str(tmp_path), "--table1")
    assert "| method | 32 | 64 | n |" in out, out
    assert re.search(r"^\| full \| 100 / 1\.50 \| 100 / 1\.50 \| 2 \|$", out, re.M), out
    assert re.search(r"^\| snapkv \| 50 / 1\.50 \| 100 / 1\.50 \| 2 \|$", out, re.M), out
    assert re.search(r"^\| snapkv \| 32 \| 8\.0 \| 0\.250 \| 0\.250 \| 0\.125 \| 32 \| 0\.125 \| 0\.125 \|$", out, re.M), out


def test_sweep_graphs_counts_capacities_against_the_plans_as_shapes():
    """Arithmetic only: per method and budget, the graphs (capacities) are a handful where the plans' numbers as
    shapes would be more, and the runtime counts read at least the plan's elements, at most 3x."""
    out = script("sweep_graphs.py", "--budgets", "256,1024", "--samples", "60")
    rows = re.findall(r"^(quest|hsa|rocketkv|sparq) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+\.\d+) +(\d+\.\d+)$", out, re.M)
    assert {(method, budget) for method, budget, *_ in rows} == {
        (m, b) for m in ("quest", "hsa", "rocketkv", "sparq") for b in ("256", "1024")}, out
    for method, _, points, graphs, shapes, median, largest in rows:
        assert int(points) == 60 and 1 <= int(graphs) <= 4 < int(shapes), out
        assert 1.0 <= float(median) <= float(largest) <= 3.0, out


@pytest.mark.integration
def test_sweep_throughput_bench_times_a_grouped_sweep_on_smollm2():
    """The grid on one short sample of the embedded SmolLM2, batched only; kvpress, an optional comparison in
    a second environment (`--kvpress-python`), is skipped with one line where it is not importable."""
    out = script("bench_sweep_throughput.py", "--seq-len", "1024", "--samples", "1", "--new-tokens", "2",
                 "--skip-one-row", timeout=600)
    assert re.search(rf"^kvbench batched\s+{NUMBER} s", out, re.M), out
    assert "grid: 13 points x 1 samples" in out, out
    if importlib.util.find_spec("kvpress") is None:
        assert "kvpress: not importable here and no --kvpress-python given; skipped" in out
