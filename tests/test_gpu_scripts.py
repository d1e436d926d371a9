"""CPU smoke tests of the GPU session's entry points (scripts/gpu_*.py, scripts/gpu_session.sh): each runs at tiny
shapes on the CPU (Triton's interpreter for the kernels, dynamo's eager backend for compiled steps), so that a
renamed function or a changed signature in kvbench breaks a test here rather than a lent GPU's session."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_compiled_decode  # noqa: E402

# a one-layer Llama of tiny_llama's sizes, through the flags that default to Llama-3.1-8B's shapes
TINY = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
NUMBER = r"\d+\.\d+"


def script(name: str, *args: str, env: dict[str, str] | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_check_kernels_runs_its_tiny_grid_in_the_interpreter():
    proc = script("gpu_check_kernels.py", "--device", "cpu", "--tiny", "--dtypes", "fp32,bf16",
                  env={"TRITON_INTERPRET": "1"})
    out = proc.stdout
    assert out.startswith("CPU (Triton interpreter)")
    for kernel in ("topk_attention", "ragged_decode", "page_minmax", "page_scores", "reduced_scores", "exact_logits"):
        for dtype in ("fp32", "bf16"):
            row = re.search(rf"^{kernel}\s+{dtype}\s+(\d+)\s+(\d+)\s+0\s+\S+\s+\S+\s+PASS$", out, re.M)
            assert row and int(row.group(1)) == int(row.group(2)) >= 2, (kernel, dtype, out[-2000:])
    passed = int(re.search(r"^(\d+) passed, 0 failed$", out, re.M).group(1))
    assert passed == sum(line.startswith("PASS  ") for line in out.splitlines()) >= 20
    # the tiny grid keeps the cases a kernel gets wrong most easily: empty heads, slack rows, k > L, padding
    assert "one empty" in out and "slack 3 rows" in out and "L=40 k=40 perm" in out and "masked" in out


def test_check_kernels_on_cpu_needs_the_interpreter():
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check_kernels.py"), "--device", "cpu", "--tiny"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 2 and "needs TRITON_INTERPRET=1" in proc.stderr


def test_decode_breakdown_times_every_method_at_tiny_shapes():
    methods = ["full", "snapkv", "adakv", "quest"]
    proc = script("gpu_decode_breakdown.py", "--device", "cpu", *TINY, "--dtype", "float32", "--length", "64",
                  "--budget", "16", "--methods", ",".join(methods), "--warmup", "1", "--steps", "2", "--profiled", "2")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("cpu: eager decode step, 1 layers, 64 prompt tokens, budget 16")
    assert lines[1].split() == ["method", "wall", "ms/step", "GPU", "busy", "ms/step", "GPU/wall", "GPU", "ops/step"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:] if line.split() and line.split()[0] in methods}
    assert list(rows) == methods
    for cells in rows.values():  # wall time measured; no CUDA events on a CPU
        assert float(cells[0]) > 0 and cells[1:] == ["0.00", "0.00", "0"]


def test_decode_floor_runs_stock_transformers_at_tiny_shapes():
    proc = script("gpu_decode_floor.py", "--device", "cpu", *TINY, "--dtype", "float32", "--lengths", "64,96",
                  "--steps", "3", "--warmup", "1")
    out = proc.stdout
    assert re.search(rf"^cpu: {NUMBER} GiB of float32 weights, copy bandwidth \d+ GB/s: weights-only floor "
                     rf"{NUMBER} ms/token$", out, re.M), out
    for length in (64, 96):
        assert re.search(rf"^L={length}: prefill {NUMBER} s, decode median {NUMBER} ms/token, p90 {NUMBER} ms "
                         rf"\(over 3 steps\), peak - \(CPU\)$", out, re.M), out


def test_profile_runner_builds_the_tiny_model_on_its_device(tmp_path, monkeypatch):
    import gpu_profile

    import kvbench.models as models

    monkeypatch.setattr(models, "_load_tiny", gpu_profile._load_tiny_on_device)  # as the script's __main__ does
    lm = models.load_model(OmegaConf.load(REPO / "kvbench" / "conf" / "model" / "tiny_llama.yaml"))
    assert {p.device.type for p in lm.model.parameters()} == {"cpu"}
    results = tmp_path / "results"
    proc = script("gpu_profile.py", "experiment=rocketkv_fig7", "model=tiny_llama", "model.device=cpu",
                  "model.dtype=float32", "task.seq_len=128", "budget=32", "method=snapkv", "task.max_new_tokens=6",
                  "profiler.repeats=1", "profiler.warmup_steps=1", "engine.compile=false", f"results_dir={results}")
    assert re.search(rf"^  decode_ms_per_token\s+{NUMBER}$", proc.stdout, re.M), proc.stdout
    [records] = list(results.rglob("records.jsonl"))
    record = json.loads(records.read_text().splitlines()[0])
    assert record["profile"]["decode_steps_timed"] == 4 and record["profile"]["decode_ms_median"] > 0


def test_compiled_decode_orders_work_across_lengths_and_reads_its_plan():
    args = gpu_compiled_decode.parse_args(["--lengths", "32768,131072"])
    assert args.plan[32768][:3] == ["full", "stock", "snapkv"] and args.plan[131072] == ["full", "stock", "snapkv", "quest"]
    assert args.check_backend == "inductor" and args.compile_estimate_s == 40.0
    order = gpu_compiled_decode.work_order({1: ["a", "b", "c"], 2: ["x"], 3: ["p", "q"]})
    assert order == [(1, "a"), (2, "x"), (3, "p"), (1, "b"), (3, "q"), (1, "c")]


def test_compiled_decode_skips_what_the_deadline_leaves_no_time_for(tmp_path):
    table = tmp_path / "rows.csv"
    out = io.StringIO()
    with redirect_stdout(out):
        rc = gpu_compiled_decode.main(["--device", "cpu", "--dtype", "float32", *TINY, "--lengths", "256,320",
                                       "--methods", "full,stock,quest", "--methods-at", "320=full", "--backend", "eager",
                                       "--no-check", "--deadline-s", "0", "--csv", str(table)])
    assert rc == 0
    text = out.getvalue()
    for length, method in [(256, "full"), (320, "full"), (256, "stock"), (256, "quest")]:
        assert re.search(rf"^\| {length} \| {method} \| - .* \| skipped: deadline", text, re.M), text
    assert "0 of 4 items measured" in text
    rows = list(csv.DictReader(table.open()))
    assert [(r["length"], r["method"], r["status"]) for r in rows] == [
        ("256", "full", "skipped"), ("320", "full", "skipped"), ("256", "stock", "skipped"), ("256", "quest", "skipped")]


def test_compiled_decode_rounds_interleave_and_name_the_attention_each_ratio_divides_by(tmp_path):
    """`--rounds 2`: kvbench's items measured twice, interleaved (stock once), their ms the median of the rounds and
    the spread beside it; every row names its decode attention and the full row's it divides by."""
    table = tmp_path / "rows.csv"
    out = io.StringIO()
    with redirect_stdout(out):
        rc = gpu_compiled_decode.main(["--device", "cpu", "--dtype", "float32", *TINY, "--lengths", "256",
                                       "--methods", "full,stock,quest,full_repeated_kv", "--budget", "32", "--steps",
                                       "2", "--warmup", "2", "--backend", "eager", "--no-check", "--rounds", "2",
                                       "--csv", str(table)])
    assert rc == 0
    text = out.getvalue()
    assert text.count("L=256 quest: ok") == 2 and text.count("L=256 stock: ok") == 1, text
    assert re.search(r"^compiled ms: median of 2 interleaved rounds; spread \(max - min\) / median: 256 full "
                     rf"{NUMBER}%, 256 quest {NUMBER}%, 256 full_repeated_kv {NUMBER}%$", text, re.M), text
    rows = {r["method"]: r for r in csv.DictReader(table.open())}
    assert rows["full"]["rounds"] == rows["quest"]["rounds"] == "2" and rows["stock"]["rounds"] == ""
    assert float(rows["quest"]["compiled_spread"]) >= 0 and rows["stock"]["compiled_spread"] == ""
    assert rows["stock"]["decode_attention"] == "stock_sdpa_static_cache"
    assert rows["full"]["decode_attention"] == rows["quest"]["decode_attention"] == "masked_capacity"  # CPU
    assert {r["baseline_attention"] for r in rows.values()} == {"masked_capacity"}
    # the loop's capacity beside the rows it holds: Quest holds the whole prompt and the loop's tokens (256 + 2
    # warmup + 2 timed) in the next capacity of the series, whose slack its page scores span
    assert (rows["quest"]["held_rows"], rows["quest"]["capacity_rows"]) == ("260", "512")
    assert rows["stock"]["held_rows"] == rows["stock"]["capacity_rows"] == ""
    # Quest's default page is a runtime input: the pages it scores, fixed by the capacity, beside the plan's
    assert re.fullmatch(r"pages \d+ for \d+", rows["quest"]["runtime_counts"]), rows["quest"]
    assert rows["full"]["runtime_counts"] == rows["stock"]["runtime_counts"] == ""
    assert "held rows / capacity rows where the capacity is 1.25x or more" in text and "256 quest 260/512" in text
    # RocketKV Fig. 7's second baseline: the repeated K/V's ms over each row's, at the same length
    for method in ("full", "quest", "full_repeated_kv"):
        row = rows[method]
        assert float(row["speedup_vs_repeated_kv"]) == pytest.approx(
            float(rows["full_repeated_kv"]["compiled_ms"]) / float(row["compiled_ms"]))


def _compiled_table(text: str) -> dict[tuple[int, str], list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 15 and cells[0].isdigit():
            rows[int(cells[0]), cells[1]] = cells[2:]
    return rows


def _check_compiled_rows(text: str, table: Path, expected: list[tuple[int, str]]) -> None:
    """Every expected (length, method) row measured on both paths, with the floor and the ratios filled in."""
    rows = _compiled_table(text)
    assert list(rows) == expected, text
    for (length, method), cells in rows.items():
        eager, compiled, compile_s, _, floor, *ratios = cells[:11]
        assert float(eager) > 0 and float(compiled) > 0 and float(compile_s) >= 0 and float(floor) > 0, cells
        assert all(float(r) > 0 for r in ratios), cells
        assert cells[-1].startswith("compiled"), cells
    records = {(int(r["length"]), r["method"]): r for r in csv.DictReader(table.open())}
    assert list(records) == expected
    for (length, method), r in records.items():
        assert r["status"] == "ok" and r["path"] == "compiled"
        if method != "stock":  # kvbench's steps after the loop's first three replay their graph
            assert int(r["replayed"]) > 0, r
        assert float(r["bytes_mb"]) == pytest.approx(float(r["weights_mb"]) + float(r["kv_aux_mb"]))
        assert float(r["compiled_over_floor"]) == pytest.approx(float(r["compiled_ms"]) / float(r["floor_ms"]))
        assert float(r["of_bytes"]) == pytest.approx(float(r["speedup_vs_full"]) / float(r["full_bytes_over_bytes"]))
        if method == "full":
            assert float(r["speedup_vs_full"]) == 1.0 and float(r["full_bytes_over_bytes"]) == 1.0
        if (length, "snapkv") in records:  # the same budget's step selecting nothing at decode
            assert float(r["compiled_over_snapkv"]) == pytest.approx(
                float(r["compiled_ms"]) / float(records[length, "snapkv"]["compiled_ms"]))
        else:
            assert r["compiled_over_snapkv"] == ""
        if method == "stock":
            assert float(r["compiled_over_stock"]) == 1.0
            # stock reads its whole static cache: the prompt, the decoded steps and 8 spare rows, K and V
            assert float(r["kv_aux_mb"]) * 1e6 == pytest.approx(2 * 2 * 16 * (length + 2 * (2 + 3 + 1) + 8) * 4)
        if method == "quest":  # a selection reads fewer K/V rows than the whole cache (plus its page summaries)
            assert float(r["kv_aux_mb"]) < float(records[length, "full"]["kv_aux_mb"])


def test_compiled_decode_measures_eager_compiled_and_stock_at_tiny_shapes(tmp_path):
    table = tmp_path / "rows.csv"
    proc = script("gpu_compiled_decode.py", "--device", "cpu", "--dtype", "float32", *TINY, "--lengths", "256",
                  "--methods", "full,stock,quest", "--budget", "32", "--steps", "3", "--warmup", "2",
                  "--backend", "eager", "--no-check", "--csv", str(table))
    assert "3 of 3 items measured" in proc.stdout
    assert "selection top-k: PyTorch's int64 topk\n" in proc.stdout  # the CPU's (a GPU names the operator)
    assert "selection scores: PyTorch's product\nselection traffic count: a mask, a scatter and a sum\n" in proc.stdout
    _check_compiled_rows(proc.stdout, table, [(256, "full"), (256, "stock"), (256, "quest")])


def run_cpu_phase(phase: str, out_dir: Path, tmp_path: Path) -> str:
    """`DEVICE=cpu gpu_session.sh PHASE OUT_DIR` (tiny shapes, no wheels), which must succeed: its stdout."""
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_session.sh"), phase, str(out_dir)], capture_output=True,
                          text=True, timeout=400, env={**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable,
                                                       "WHEELS": str(tmp_path / "no-wheels")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.integration
def test_session_compiled_phase_runs_on_cpu_at_tiny_shapes(tmp_path):
    """`DEVICE=cpu gpu_session.sh compiled`: the shell phase, the sharded static-decode check and the table (~40 s)."""
    out_dir = tmp_path / "out"
    text = run_cpu_phase("compiled", out_dir, tmp_path)
    assert re.search(r"^=== compiled_decode: exit 0 after \d+s$", text, re.M)
    assert "2 processes side by side" in text
    for label in ("full", "snapkv"):  # the merged check table: one graph, no recompile, tokens equal, 4 steps of
        # which the fourth replayed (three guarded calls), the decode statistics equal
        assert re.search(rf"^{label}\s+compiled\s+1\s+0\s+0\s+equal\s+\S+\s+1\s+3\s+equal$", text, re.M), text
    assert "static-decode check: all methods as expected" in text
    _check_compiled_rows(text, out_dir / "compiled_decode.csv",
                         [(256, "full"), (320, "full"), (256, "stock"), (320, "stock"), (256, "snapkv"), (256, "quest")])
    assert (out_dir / "compiled_decode.log").read_text().count("| 256 | full |") == 1


@pytest.mark.integration
def test_session_kernel_phase_runs_on_cpu_at_tiny_shapes(tmp_path):
    """`DEVICE=cpu gpu_session.sh kernel`: the split-K decode attention against the masked PyTorch attention
    (the kernel interpreted), the stable top-k four ways at each selection's shape, and a compiled step's
    breakdown with its top-kernels table (~40 s)."""
    text = run_cpu_phase("kernel", tmp_path / "out", tmp_path)
    for name in ("bench_flash_decode", "bench_stable_topk", "kernel_breakdown"):
        assert re.search(rf"^=== {name}: exit 0 after \d+s$", text, re.M), text
    topk = re.findall(r"^\| 300 \| (\w+) \| \d+ x \d+ \| \d+ \| (\w+) \| [\d.]+ \| [\d.]+ \| (yes|no) \|$", text, re.M)
    assert [case for case, *_ in topk[::5]] == ["quest", "quest_page16", "token_shared", "token_per_query_head"]
    assert [way for _, way, _ in topk[:5]] == ["keys_topk", "keys_topk_inductor", "float_topk", "stable_topk",
                                               "stable_topk_unordered"]
    assert all(equal == "yes" for _, way, equal in topk if way != "float_topk"), topk  # the reference's indices
    rows = re.findall(r"^\| 200 \| (\w+) \| ([\d.]+) \| \d+ \| [\d.]+ \| ([\d.e+-]+) \|$", text, re.M)
    assert [way for way, *_ in rows] == ["flash_decode", "padded_inductor", "selected_flash", "selected_inductor"], text
    assert all(float(diff) < 0.02 for *_, diff in rows), rows  # bf16 outputs against the fp32 oracle
    for method in ("full", "snapkv", "quest", "exact_topk", "sparq"):
        assert re.search(rf"^{method}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+$", text, re.M), text
    assert text.count("us/step  share launches/step  kernel") == 5


@pytest.mark.integration
def test_session_selection_phase_runs_on_cpu_at_tiny_shapes(tmp_path):
    """`DEVICE=cpu gpu_session.sh selection`: issue 45's one-call phase without its CUDA-only steps (the tests
    compiled on CUDA, the compiled phase, run by the test above): the stable top-k bench and the selection
    methods' kernel breakdown (~15 s)."""
    text = run_cpu_phase("selection", tmp_path / "out", tmp_path)
    for name in ("bench_stable_topk", "bench_stacked_projections", "kernel_breakdown"):
        assert re.search(rf"^=== {name}: exit 0 after \d+s$", text, re.M), text
    assert "=== compiled_decode" not in text
    # the weight products separate and stacked: the stacked outputs within 16-bit rounding of the separate ones
    ways = re.findall(r"^\| (separate|stacked) \| (\d) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \| \d+ \| [\d.]+ \| ([\d.e+-]+) \|$",
                      text, re.M)
    assert [(way, products) for way, products, *_ in ways] == [("separate", "7"), ("stacked", "4")], text
    assert ways[0][2] == "1.000" and all(float(diff) < 0.05 for *_, diff in ways), ways
    for method in ("quest", "sparq", "exact_topk"):
        assert re.search(rf"^{method}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+$", text, re.M), text


def test_stacked_projections_bench_runs_the_models_stacking_at_tiny_shapes():
    """`bench_stacked_projections.py`: seven products a layer separate, four once `pack_projections` stacks them
    (the assertion inside counts two stacked products a layer), the same outputs within bf16 rounding."""
    import bench_stacked_projections

    with redirect_stdout(io.StringIO()):
        rows = bench_stacked_projections.main(["--device", "cpu", *TINY, "--layers", "2", "--repeats", "2"])
    assert [row["way"] for row in rows] == ["separate", "stacked"] and rows[0]["ratio"] == 1.0
    assert all(row["us"] > 0 and row["diff"] < 0.05 for row in rows), rows


def test_bisection_counts_replay_the_kernels_early_stop():
    """`stable_topk_bisection_counts.py` (docs/journal/gpu.md section 8b's counts): fewer than 32 counts on distinct fp32 rows,
    never more than 32."""
    proc = script("stable_topk_bisection_counts.py", "--rows", "3")
    rows = re.findall(r"^(.+?)\s+([\d.]+)\s+(\d+)\s+(\d+)$", proc.stdout, re.M)
    assert len(rows) == 5, proc.stdout
    assert all(float(mean) < 32 for name, mean, *_ in rows if "bf16" not in name), rows
    assert all(int(most) <= 32 for *_, most in rows), rows


def test_count_step_kernels_traces_each_selection_through_the_cuda_operators():
    """`count_step_kernels.py` on the tiny Llama: under the CUDA rule each layer of Quest's step holds its two page-bound
    products, its page top-k and the attention as kvbench operators (three more than full's: its default page is a
    runtime input, `RuntimePage`, whose tokens come from the ordered pages by arithmetic, with no held-tokens top-k),
    Exact-TopK's its exact logits, top-k, traffic count and attention, SparQ's its reduced scores and top-k
    besides the attention."""
    proc = script("count_step_kernels.py", "--model", "tiny_llama", "--methods", "full,quest,exact_topk,sparq",
                  "--list")
    rows = re.findall(r"^(\w+)\s+\d+\s+\d+\s+(\d+)\s+-?\d+\s+(-?\d+)$", proc.stdout, re.M)
    assert {method: ops for method, _, ops in rows} == {"full": "0", "quest": "6", "exact_topk": "6", "sparq": "4"}, \
        proc.stdout  # two layers
    # float32: unstacked, as on CUDA: seven products a layer and the output head
    assert {products for _, products, _ in rows} == {"15"}, proc.stdout
    assert "op kvbench.distinct_rows" in proc.stdout.split("exact_topk:")[1].split("sparq:")[0]


@pytest.mark.integration
def test_session_big_model_phase_runs_on_cpu_at_tiny_shapes(tmp_path):
    """`DEVICE=cpu gpu_session.sh big`: a tiny Llama built in place in NF4 (bitsandbytes' CPU backend), prefill and
    decode for full, SnapKV and OmniKV with the weights counted at their real size (~20 s)."""
    pytest.importorskip("bitsandbytes")
    text = run_cpu_phase("big", tmp_path / "out", tmp_path)
    assert re.search(r"^=== big_model: exit 0 after \d+s$", text, re.M), text
    built = re.search(r"^built 4 layers \(bnb_4bit, bfloat16 compute, random weights\) on cpu .*weights per device: "
                      r"cpu ([\d.]+) GiB", text, re.M)
    assert built, text
    for method in ("full", "snapkv", "omnikv"):  # eager: a placed model is not compiled
        assert re.search(rf"^\| {method} \| 96 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| eager \| host: ", text, re.M), text


def test_big_model_builds_4bit_linear_layers_and_keeps_the_rest_in_the_compute_dtype():
    """The in-place build quantises exactly the decoder's linear layers, on the device, as transformers' quantizer
    would (NF4, bf16 compute); the output head, embeddings and norms stay bf16; the weights count at their real
    size (packed 4-bit data plus the quantisation state), under half the bf16 size of the linear layers."""
    pytest.importorskip("bitsandbytes")
    import gpu_big_model
    from bitsandbytes.nn import Linear4bit

    args = gpu_big_model.parse_args(["--device", "cpu", "--layers", "2", "--hidden", "64", "--intermediate", "128",
                                     "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "260"])
    lm = gpu_big_model.build(args, torch.device("cpu"), torch.bfloat16)
    linear = [m for m in lm.model.modules() if isinstance(m, Linear4bit)]
    assert len(linear) == 2 * 7 and all(m.weight.quant_state.quant_type == "nf4" for m in linear)
    assert all(m.compute_dtype == torch.bfloat16 for m in linear)
    assert not isinstance(lm.model.lm_head, Linear4bit) and lm.model.lm_head.weight.dtype == torch.bfloat16
    assert lm.dtype == torch.bfloat16 and lm.quantization == "bnb_4bit" and lm.sharded
    assert not any(p.is_meta for p in lm.model.parameters())
    linear_params = sum(m.in_features * m.out_features for m in linear)
    other = sum(p.numel() * 2 for n, p in lm.model.named_parameters() if "proj" not in n)
    counted = sum(lm.weight_bytes_by_device().values())
    assert linear_params * 0.5 < counted - other < linear_params * 2 * 0.5


def test_session_names_its_phases_on_a_wrong_one(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_session.sh"), "nope", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable,
                                                       "WHEELS": str(tmp_path / "no-wheels")})
    assert proc.returncode == 2 and "check|profile|breakdown|compiled|kernel|selection|batched|big|all" in proc.stderr


def test_batched_decode_phase_decodes_a_sweeps_points_one_by_one_and_batched_on_cpu(tmp_path):
    """`DEVICE=cpu gpu_session.sh batched` (scripts/gpu_batched_decode.py at tiny shapes): the probe's verdict, the points
    alone, batched with the same tokens, and compiled one by one, each against its floor, in the CSV too."""
    out_dir = tmp_path / "out"
    text = run_cpu_phase("batched", out_dir, tmp_path)
    assert re.search(r"^=== batched_decode: exit 0 after \d+s$", text, re.M)
    assert "7 points, batch_rows 7, row block 4" in text  # full + snapkv, adakv, quest at 2 budgets
    assert "probe: batch-invariant" in text
    rows = {r["mode"]: r for r in csv.DictReader((out_dir / "batched_decode.csv").open())}
    assert list(rows) == ["one_by_one", "batched", "compiled_one_by_one"], text
    assert rows["batched"]["tokens_equal"] == "7/7" and rows["batched"]["rows"] == "7"
    for row in rows.values():
        assert float(row["ms_per_row_token"]) > 0 and float(row["over_floor"]) > 1
    assert float(rows["batched"]["ms_per_step"]) == pytest.approx(7 * float(rows["batched"]["ms_per_row_token"]))
    assert re.search(rf"^batched over one by one, per row-token: {NUMBER}x \(floors allow {NUMBER}x\)$", text, re.M)
