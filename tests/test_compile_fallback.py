"""The compiled decode step on every torch that installs, and nothing about compiling stopping a run.

GPU machines run torch 2.11, whose `torch.compile` has no `recompile_limit` or `isolate_recompiles` (2.12) and
raises TypeError on them; torch 2.5-2.7 have no `guard_filter_fn` either. These tests stand a wrapper with 2.11's
signature in for `torch.compile` (Python raises the same TypeError on an argument it lacks), and make the
decoder's construction, the trace and the backend's compile fail in turn: each point still completes, compiled
where it can and otherwise eagerly with one warning line and the reason in its record. Compiled points use dynamo's
"eager" backend (the trace is dynamo's; no code generation on two cores)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import kvbench.engine.compiled as compiled
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.methods import build_method
from tests.conftest import random_ids
from tests.test_engine import kv_sample
from tests.test_static_decode import greedy_decode

REAL_COMPILE = torch.compile


def compile_of_torch_2_11(guard_filter: bool = True):
    """`torch.compile` with torch 2.11's signature (no recompile_limit, no isolate_recompiles), calling the real
    one. Without `guard_filter` it is 2.5-2.7's as well: the option is then an unknown inductor option, which
    inductor refuses (and `torch.compiler.skip_guard_on_all_nn_modules_unsafe` is absent: the test deletes it)."""

    def compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                disable=False):
        if not guard_filter and options and "guard_filter_fn" in options:
            raise RuntimeError("Unexpected optimization option guard_filter_fn")
        return REAL_COMPILE(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                            options=options, disable=disable)

    return compile


@pytest.fixture
def fresh(tiny_llama, monkeypatch):
    """Compiled points through `engine.compile` with the eager backend, on decoders made under this test's
    patches (the model keeps its decoders; this test's are dropped after it), dynamo's limits restored after."""
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    monkeypatch.setitem(tiny_llama.model.__dict__, "_kvbench_decoders", {})
    # set back by hand: monkeypatch would delete a config entry it set (the module holds none in its __dict__)
    limits = {name: getattr(torch._dynamo.config, name) for name in ("recompile_limit", "accumulated_recompile_limit")}
    yield tiny_llama
    for name, value in limits.items():
        setattr(torch._dynamo.config, name, value)


def compile_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "compile" in r.getMessage()]


@pytest.mark.parametrize("guard_filter", [True, False], ids=["torch-2.11", "no-guard-filter"])
def test_a_compiled_point_runs_on_torch_2_11s_compile(fresh, monkeypatch, caplog, guard_filter):
    monkeypatch.setattr(torch, "compile", compile_of_torch_2_11(guard_filter))
    if not guard_filter:
        monkeypatch.delattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")
    sample = kv_sample(2)
    eager = run_sample(fresh, build_method("quest"), 64, sample, EngineConfig())
    with caplog.at_level(logging.WARNING):
        on = run_sample(fresh, build_method("quest"), 64, sample, EngineConfig(compile=True))
    assert compile_warnings(caplog) == []
    assert on["decode_path"] == "compiled" and on["decode_path_reason"] is None and on["decode_compiles"] >= 1
    assert [t["prediction"] for t in on["turns"]] == [t["prediction"] for t in eager["turns"]]
    # without the per-call limit, the decoder raised dynamo's own
    assert torch._dynamo.config.recompile_limit >= compiled.RECOMPILE_LIMIT


def test_two_decoders_keep_their_graphs_and_their_limits_apart(fresh, monkeypatch):
    """Under 2.11's compile, with a limit of one graph per decoder: two decoders of one model and backend each
    compile their own graph for the same point (one code object for both would give the second the first's graph,
    as the model's module guards are dropped, and its compile would be past the shared limit); a second point on
    the first decoder is past that decoder's limit, and decodes eagerly."""
    monkeypatch.setattr(torch, "compile", compile_of_torch_2_11())
    monkeypatch.setattr(compiled, "RECOMPILE_LIMIT", 1)
    torch._dynamo.config.recompile_limit = 1
    first, second = compiled.CompiledDecoder(fresh, "eager"), compiled.CompiledDecoder(fresh, "eager")
    assert first.step_code is not second.step_code
    ids = random_ids(120, seed=6)
    tokens = []
    for decoder in (first, second):
        session, token = greedy_decode(fresh, build_method("quest"), 32, ids, 3, decoder)
        session.end_decode()
        assert (session.compiles, session.static_steps) == (1, 3), session.decode_path_reason
        tokens.append(token)
    assert tokens[0] == tokens[1]
    assert [len(_debug_get_cache_entry_list(d.step_code)) for d in (first, second)] == [1, 1]
    other, _ = greedy_decode(fresh, build_method("snapkv", window=8), 32, ids, 3, first)
    other.end_decode()
    assert other.decode_path == "eager" and "FailOnRecompileLimitHit" in other.decode_path_reason


class InductorStyleError(Exception):
    """What a backend raises that is no dynamo exception."""


def backend_raising(exc: BaseException):
    def backend(graph_module, example_inputs):
        raise exc

    return backend


def inductor_error() -> BaseException:
    # what inductor raises when Triton refuses a kernel (torch 2.11 on CUDA, the old descending_keys)
    return torch._inductor.exc.InductorError(ValueError("Scalar 4294967295 is out of range for type int32"), None)


def break_the_trace(monkeypatch, lm):
    """A graph break in the model's forward while dynamo traces it (an error under fullgraph); eager unchanged."""
    forward = type(lm.model).forward

    def traced_with_a_break(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(lm.model), "forward", traced_with_a_break)


def fail_dynamo_internally(monkeypatch, lm):
    """An AssertionError inside dynamo at the end of the trace: dynamo re-raises it as it is (no dynamo exception)."""

    def compile_subgraph(*args, **kwargs):
        raise AssertionError("an internal check of dynamo's failed")

    monkeypatch.setattr(torch._dynamo.output_graph.OutputGraph, "compile_subgraph", compile_subgraph)


def refuse_to_compile(monkeypatch, lm):
    """`torch.compile` raising, as 2.11's did on the arguments the decoder used to pass it."""

    def compile(*args, **kwargs):
        raise TypeError("compile() got an unexpected keyword argument 'isolate_recompiles'")

    monkeypatch.setattr(torch, "compile", compile)


FAILURES = {
    # while constructing the decoder
    "torch.compile raises": refuse_to_compile,
    "torch below 2.5": lambda mp, lm: mp.delattr(torch.library, "custom_op"),
    # while tracing the step
    "graph break": break_the_trace,
    "dynamo's own AssertionError": fail_dynamo_internally,
    # while the backend compiles the graph
    "InductorError": lambda mp, lm: mp.setattr(compiled, "BACKEND", backend_raising(inductor_error())),
    "a backend's own error": lambda mp, lm: mp.setattr(compiled, "BACKEND", backend_raising(
        InductorStyleError("Scalar 4294967295 is out of range for type int32"))),
    "a backend's IndexError": lambda mp, lm: mp.setattr(compiled, "BACKEND", backend_raising(
        IndexError("index 3 is out of bounds"))),  # dynamo re-raises an IndexError unwrapped
}
REASONS = {
    "torch.compile raises": "TypeError: compile() got an unexpected keyword argument 'isolate_recompiles'",
    "torch below 2.5": "lacks torch.library.custom_op (the compiled decode step needs torch >= 2.5)",
    "graph break": "Unsupported",
    "dynamo's own AssertionError": "AssertionError: an internal check of dynamo's failed",
    "InductorError": "InductorError: ValueError: Scalar 4294967295 is out of range for type int32",
    "a backend's own error": "InductorStyleError: Scalar 4294967295 is out of range for type int32",
    "a backend's IndexError": "IndexError: index 3 is out of bounds",
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_compile_that_fails_anywhere_falls_back_to_eager_with_one_warning(fresh, monkeypatch, caplog, failure):
    sample = kv_sample(1)
    eager = run_sample(fresh, build_method("snapkv", window=8), 48, sample, EngineConfig())
    FAILURES[failure](monkeypatch, fresh)
    with caplog.at_level(logging.WARNING):
        fallen = run_sample(fresh, build_method("snapkv", window=8), 48, sample, EngineConfig(compile=True))
    warnings = compile_warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert fallen["decode_path"] == "eager" and fallen["decode_path_reason"].startswith("compile failed: ")
    assert REASONS[failure] in fallen["decode_path_reason"], fallen["decode_path_reason"]
    assert REASONS[failure] in warnings[0]
    assert fallen["turns"][0]["prediction"] == eager["turns"][0]["prediction"] and fallen["nll"] == eager["nll"]


def test_an_error_from_running_a_compiled_graph_is_the_runs_own(fresh):
    """A graph that ran may have written the cache in place: its error stops the run, as an eager step's would,
    instead of a retry on a cache it may have changed."""

    def backend(graph_module, example_inputs):
        def run(*args):
            raise RuntimeError("a device error while the graph ran")

        return run

    with pytest.raises(RuntimeError, match="while the graph ran"):
        greedy_decode(fresh, build_method("snapkv", window=8), 48, random_ids(120, seed=6), 2,
                      compiled.CompiledDecoder(fresh, backend))


@pytest.mark.parametrize("setting,warned", [("true", True), ("auto", False)])
def test_a_method_that_cannot_compile_says_so_once_where_compiling_was_asked(tmp_path, setting, warned):
    """engine.compile=true (or auto on CUDA) with a method whose step needs host work (MagicPIG's LSH over keys
    in host memory): the point decodes eagerly with one warning line naming the reason its records carry;
    auto on a CPU asks for nothing and says nothing."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "kvbench", "model=tiny_llama", "task=twostage_retr", "task.num_samples=1",
         "task.max_new_tokens=2", "engine.nll=false", "method=magicpig", "budget=64", f"engine.compile={setting}",
         "show_progress=false", f"results_dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if "[WARNING]" in line]
    record = json.loads(next(tmp_path.rglob("records.jsonl")).read_text().splitlines()[0])
    assert record["decode_path"] == "eager"
    if warned:
        assert len(warnings) == 1, warnings
        assert "magicpig decodes eagerly although engine.compile=true asks for the compiled step" in warnings[0]
        assert record["decode_path_reason"] and record["decode_path_reason"] in warnings[0]
    else:
        assert warnings == [] and record["decode_path_reason"] is None
