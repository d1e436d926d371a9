"""The graph lint (`kvbench.devtools.graph_lint`): every static method's decode graph is free of what Triton's code
generation refuses, and a step with such a construct (the old `descending_keys`) is named with its constant."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import kvbench.kernels.stable_topk as stable_topk
import kvbench.methods.common.pages as pages
from kvbench.devtools import static_decode as check_static_decode
from kvbench.devtools.graph_lint import lint_backend
from kvbench.engine.compiled import CompiledDecoder
from kvbench.methods import build_method

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from probe_triton_lint import old_keys as old_descending_keys  # noqa: E402


def lint(fn, *args):
    """Compile `fn` with the lint's backend and run it: the lint's error, or None."""
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=lint_backend(), fullgraph=True)(*args)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        return str(exc.inner_exception)
    return None


def test_the_lint_flags_an_out_of_int32_constant_on_an_index_and_nothing_else():
    scores = torch.randn(3, 50)
    error = lint(old_descending_keys, scores)
    assert error is not None and "4294967295" in error and "pages" not in error  # traced from the old keys' file
    assert lint(stable_topk.descending_keys, scores) is None
    # an index through views and casts, then a where with int64's maximum (as a masked argmin pads): flagged
    assert "9223372036854775807" in lint(
        lambda s: torch.where(s > 0, (torch.arange(s.shape[-1]) - 32).abs()[None], torch.iinfo(torch.int64).max),
        scores)
    # the same constant on values that are not indices (DuoAttention's sentinel): Triton widens it, not flagged
    assert lint(lambda s: torch.where(s > 0, torch.iinfo(torch.int64).max, 68), scores) is None
    assert lint(lambda s: s.to(torch.int64) + (1 << 40), scores) is None
    # an arange starting outside int32 is an index expression with that constant
    assert "4294967296" in lint(lambda s: s + torch.arange(1 << 32, (1 << 32) + s.shape[-1]), scores)


def old_held_first(tokens: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """`held_first` before the fix: positions by cumulative sums, a scan inductor split on CUDA and failed to
    generate (torch 2.11, Quest's 640 pages)."""
    held = ~past
    position = torch.where(held, held.cumsum(-1), held.sum(-1, keepdim=True) + past.cumsum(-1)) - 1
    return torch.empty_like(tokens).scatter_(-1, position, tokens)


def test_the_lint_flags_a_scan_inductor_would_split_and_not_the_held_first_that_replaced_it():
    tokens = torch.arange(8 * 640).view(8, 640)
    past = tokens % 7 == 0
    error = lint(old_held_first, tokens, past)
    assert error is not None and "640 (elements scanned" in error and "cumsum" in error
    assert lint(lambda t, p: pages.held_first(t, p, 600), tokens, past) is None
    assert torch.equal(pages.held_first(tokens, past, 600), old_held_first(tokens, past)[:, :600])
    assert lint(lambda t: t.cumsum(-1), tokens[:, :32]) is None  # 32 elements: never split
    assert "33 (elements scanned" in lint(lambda t: t.float().cumprod(-1), tokens[:, :33])


def test_the_descending_keys_order_is_unchanged_by_the_fix():
    scores = torch.randint(-3, 4, (4, 300)).float()  # many ties
    scores[0, 5] = -0.0
    assert torch.equal(stable_topk.descending_keys(scores).argsort(dim=-1, descending=True),
                       old_descending_keys(scores).argsort(dim=-1, descending=True))
    assert torch.equal(stable_topk.descending_keys(scores) - old_descending_keys(scores),
                       torch.full((4, 300), -(1 << 31)))


def test_every_static_methods_decode_graph_passes_the_lint(tiny_qwen3):
    """The table of scripts/check_static_decode.py, each method's step traced once (two steps: a method whose
    schedule evicts runs the loop's first step eagerly), from prompts as short as the methods allow. On tiny
    Qwen3 (Llama's step and its q/k norms); tests/test_cuda_codegen.py has Triton compile tiny Llama's steps."""
    lm = tiny_qwen3
    decoder = CompiledDecoder(lm, lint_backend())
    for label, name, settings, budget in check_static_decode.STATIC:
        ids = check_static_decode.prompt(budget + 10 if budget > 640 else 200, seed=1)  # DuoAttention's rule: > 640
        session, _, _ = check_static_decode.decode(lm, check_static_decode.method_for(lm, name, settings), budget,
                                                   ids, 2, decoder)
        assert session.decode_path == "compiled", f"{label}: {session.decode_path_reason}"


def test_a_step_with_the_old_descending_keys_fails_the_lint_naming_its_constant(tiny_llama, monkeypatch):
    monkeypatch.setattr(stable_topk, "descending_keys", old_descending_keys)
    decoder = CompiledDecoder(tiny_llama, lint_backend())
    session, _, _ = check_static_decode.decode(tiny_llama, build_method("quest"), 64,
                                               check_static_decode.prompt(300, seed=1), 2, decoder)
    assert session.decode_path == "eager"
    assert "GraphLintError" in session.decode_path_reason and "4294967295" in session.decode_path_reason
