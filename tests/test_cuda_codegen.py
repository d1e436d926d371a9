"""Triton's CUDA compiler on the CPU (`kvbench.devtools.cuda_target`, `scripts/check_cuda_codegen.py`): every
kernel of `kvbench.kernels` at a GPU run's shapes, and inductor's Triton code for every static method's decode
step, compile for an H100, and what Triton refused on one is refused here: the old `descending_keys`, and the
six graphs of `scripts/probe_triton_lint.py`, with the H100's verdicts.

Each test runs in a process of its own without `TRITON_INTERPRET` (the suite's kernels run in Triton's
interpreter, which compiles nothing, and triton reads the variable once, when it is imported)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("triton")


def run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT / "scripts")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_kvbench_kernel_compiles_for_an_h100_at_the_configured_models_shapes():
    proc = run(["scripts/check_cuda_codegen.py", "--part", "kernels", "--archs", "h100"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nothing refused" in proc.stdout
    assert "kvbench.kernels for sm_90" in proc.stdout
    for kernel in ("_flash_decode_split_kernel", "_flash_decode_merge_kernel", "_stable_topk_kernel",
                   "_ragged_decode_kernel", "_topk_attention_kernel", "_page_minmax_kernel",
                   "_group_scores_kernel", "_distinct_rows_kernel"):
        assert kernel in proc.stdout, kernel
    # the selected-rows split kernel and the long rows' second top-k pass were compiled too
    assert "INDEXED=True" in proc.stdout and "GATHER=True, ORDERED=True" in proc.stdout
    assert "GATHER=False, IEEE=False" in proc.stdout  # the exact logits' bf16 tensor-core product
    # and at every configured model's attention shape: no GQA (Llama-2), groups of 3, 7 and 8, head dim 64
    compiled = re.findall(r"^== (\S+) \(.*\): (\d+) kernels compiled", proc.stdout, re.M)
    assert [model for model, _ in compiled] == ["llama3.1_8b", "llama3.1_70b", "llama3.2_3b", "qwen2.5_7b",
                                                "qwen2.5_3b", "yi_9b", "longchat_7b", "smollm2_135m"]
    assert all(int(count) >= 48 for _, count in compiled)  # 13 launches of 1-3 kernels, 2 lengths x 2 dtypes
    assert "BLOCK_D=64" in proc.stdout


def test_every_static_methods_decode_step_compiles_for_an_h100():
    """All of check_static_decode's static methods on tiny Llama in float32; on tiny Qwen3 (its q/k norms) in
    bfloat16 (a GPU run's dtype: other casts, other kernels) the full and Quest steps; on one layer of
    Llama-3.1-8B's widths (reductions that loop) a budgeted, a page-selecting and the two-stage step."""
    for model, methods, dtype in (("tiny_llama", "all", "float32"), ("tiny_qwen3", "full,quest", "bfloat16"),
                                  ("llama3.1_8b_layer", "snapkv,quest,rocketkv", "bfloat16")):
        proc = run(["scripts/check_cuda_codegen.py", "--part", "steps", "--models", model, "--methods", methods,
                    "--model-dtype", dtype], timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "nothing refused" in proc.stdout and "REFUSED" not in proc.stdout
        rows = [line.split() for line in proc.stdout.splitlines() if line.split()[1:2] == ["compiled"]]
        assert f"{model} (torch.{dtype})" in proc.stdout
        assert len(rows) == (21 if methods == "all" else len(methods.split(",")))
        assert all(int(row[3]) > 10 for row in rows)  # kernels generated and compiled: the check is not vacuous


def h100_verdicts() -> dict[str, bool]:
    """Whether inductor and Triton on an H100 (torch 2.11, triton 3.6) refused each graph of
    `scripts/probe_triton_lint.py`: its log, recorded in docs/journal/gpu.md (section 6)."""
    log = (ROOT / "docs" / "gpu" / "logs" / "probe_triton_lint.log").read_text().splitlines()
    cases = [line.removeprefix("CASE ") for line in log if line.startswith("CASE ")]
    inductor = [line.strip() for line in log if line.startswith("  inductor: ")]
    return {case: verdict.startswith("inductor: REFUSED") for case, verdict in zip(cases, inductor, strict=True)}


def test_what_triton_refuses_on_a_gpu_is_refused_here_naming_the_kernel(tmp_path):
    program = textwrap.dedent("""
        import torch, triton, triton.language as tl
        import check_cuda_codegen, probe_triton_lint
        import kvbench.kernels.stable_topk as stable_topk
        from kvbench.core.errors import one_line
        from kvbench.devtools.graph_lint import cuda_codegen_backend
        from kvbench.devtools.cuda_target import TritonRefusal, compile_launches

        @triton.jit
        def reversed_index(out_ptr, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            tl.store(out_ptr + i, 4294967295 - i)  # as inductor printed the old descending_keys' index

        try:
            with compile_launches(90) as compiled:
                reversed_index[(1,)](torch.zeros(64, dtype=torch.int64), BLOCK=64)
            print("accepted", compiled)
        except TritonRefusal as exc:
            print("launch refused:", exc)

        for name, fn in probe_triton_lint.CASES.items():
            torch._dynamo.reset()
            try:
                torch.compile(fn, backend=cuda_codegen_backend(90), fullgraph=True)(torch.randn(3, 300))
                print("CASE", name, "| ok")
            except Exception as exc:
                print("CASE", name, "| REFUSED", one_line(exc))

        stable_topk.descending_keys = probe_triton_lint.old_keys
        refused = check_cuda_codegen.check_steps(90, ["tiny_llama"], {"quest", "snapkv"})
        print("steps refused:", refused)
    """)
    (tmp_path / "refusals.py").write_text(program)  # a file: @triton.jit reads its function's source
    proc = run([str(tmp_path / "refusals.py")], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launch refused: reversed_index for sm_90: CompilationError:" in proc.stdout
    assert "4294967295 is out of range for type int32" in proc.stdout
    # the probe's six graphs: refused here exactly where the H100 refused them (the lint flags a third, wrongly)
    here = {line[5:].split(" | ")[0]: " | REFUSED" in line for line in proc.stdout.splitlines()
            if line.startswith("CASE ")}
    assert here == h100_verdicts() and sum(here.values()) == 2
    refused = proc.stdout.split("steps refused:")[1]
    # Quest's step selects pages by the old keys: refused, so it falls back to eager, as on the H100; SnapKV's does not
    assert "tiny_llama quest: compile failed: BackendCompilerFailed: TritonRefusal: triton_" in refused
    assert "4294967295 is out of range" in refused and "snapkv" not in refused


def test_the_rotary_embeddings_rotate_half_is_one_kernel_as_a_gpu_lowers_it():
    """`gpu_lowering_rules`: inductor's CPU rule copies each input of a `cat` by a kernel of its own, so the rotary
    embedding (`x cos + cat(-x2, x1) sin`) became three kernels where a GPU's compile makes one (the H200's
    profile names the rotary kernels `..._cat_cos_mul_neg_sin_...`, docs/journal/gpu.md section 7). Generated as for a GPU,
    it is one kernel; the rules are undone on leaving (inductor's own table is the CPU's again)."""
    program = textwrap.dedent("""
        import torch
        import torch._inductor.lowering as lowering
        from kvbench.devtools import graph_lint

        def rotary(x, cos, sin):
            return x * cos + torch.cat((-x[..., 64:], x[..., :64]), dim=-1) * sin

        cpu_cat = lowering.lowerings[torch.ops.aten.cat.default]
        for rules in ("gpu", "cpu"):
            names = []

            def backend(graph_module, example_inputs):
                if rules == "cpu":  # the CPU's rule for the cat, inside the same code generation
                    graph_lint.gpu_lowering_rules = graph_lint.contextlib.nullcontext
                names.extend(name for name, _ in graph_lint.inductor_triton_sources(graph_module, example_inputs))
                return graph_module.forward

            torch._dynamo.reset()
            x, angle = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16), torch.randn(1, 1, 1, 128)
            torch.compile(rotary, backend=backend)(x, angle.cos(), angle.sin())
            print(rules, names)
        print("restored", lowering.lowerings[torch.ops.aten.cat.default] is cpu_cat)
    """)
    proc = run(["-c", program], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gpu = re.search(r"^gpu \[(.*)\]$", proc.stdout, re.M).group(1).split(", ")
    cpu = re.search(r"^cpu \[(.*)\]$", proc.stdout, re.M).group(1).split(", ")
    assert len(gpu) == 1 and "cat" in gpu[0] and "neg" in gpu[0], proc.stdout
    assert len(cpu) == 3, proc.stdout
    assert "restored True" in proc.stdout
