"""The static decode layout and the compiled decode step (`engine.compile`): one graph per method and capacity
bucket, no recompile within a sample, the eager path's tokens, and the layout's bookkeeping.

Graph counts come from dynamo's "eager" backend (`scripts/check_static_decode.py`): it traces the whole step as
inductor does, in seconds. One test compiles with inductor itself."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

import kvbench.engine.compiled as compiled
from kvbench.cache.static import CAPACITY_BUCKET, bucketed
from kvbench.core.errors import KVBenchError
from kvbench.devtools import static_decode as check_static_decode
from kvbench.engine.config import EngineConfig
from kvbench.engine.replay import GUARDED_CALLS, CudaGraphCapture, GraphCall, LoopReplays, StepInputs
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.kernels.decode_attention import decode_attention_reference, static_decode_attention
from kvbench.methods import build_method
from kvbench.methods.common.pages import held_first, top_page_tokens
from kvbench.methods.keydiff import ANCHORS, keydiff_scores
from tests.conftest import random_ids
from tests.test_engine import kv_sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_decode_latency  # noqa: E402


@pytest.fixture
def eager_backend(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "eager")


def greedy_decode(lm, method, budget: int, ids: list[int], steps: int, decoder) -> tuple[Session, int]:
    """Prefill and compress `ids`, then `steps` greedy decode steps through `decoder` (None: eagerly). The session,
    still in its decode loop (the caller ends it), and the last token."""
    session = Session(lm, method, budget)
    logits, _ = session.prefill(ids, compress=True)
    session.decoder = decoder
    session.begin_decode(steps)
    token = int(logits.argmax())
    for _ in range(steps):
        token = int(session.step(token).argmax())
    return session, token


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_every_static_method_is_one_graph_without_recompiles_and_keeps_the_eager_tokens(model, capsys):
    outcomes = check_static_decode.main(["--models", model, "--backend", "eager"])
    report = capsys.readouterr().out
    static = {o.label for o in outcomes if o.path == "compiled"}
    assert static == {label for label, *_ in check_static_decode.STATIC}, report
    assert all(o.ok for o in outcomes), report
    for o in outcomes:
        if o.path == "compiled":  # float32: the static attention sums in another order, nothing more
            assert o.graphs == 1 and o.recompiles == 0 and o.second_sample == 0 and o.tokens_equal, o
            assert o.max_logit_diff < 1e-4, o
        else:  # host work every step: eager, and it says what the work is
            assert o.label in {label for label, *_ in check_static_decode.EAGER} and "every decode step" in o.path, o


def test_the_estimate_dimensions_as_runtime_inputs_keep_the_eager_tokens_in_bfloat16(capsys):
    """HSA's k1 and SparQ's r are runtime inputs: the compiled step takes more dimensions than the plan's and
    zeroes the rest. In bfloat16 the group sums of |q| tie, and `torch.topk` breaks ties by its algorithm, which
    depends on k: the first k1 of a longer top-k were another dimension than the top k1 (tiny Llama, HSA: tokens
    differed, logits by 0.98) until both took the stable top-k (`kvbench.methods.common.dims.top_dims`)."""
    outcomes = check_static_decode.main(["--models", "tiny_llama", "--backend", "eager", "--dtype", "bfloat16",
                                         "--methods", "hsa,sparq,rocketkv"])
    report = capsys.readouterr().out
    assert [o.path for o in outcomes] == ["compiled"] * 3, report
    assert all(o.ok and o.tokens_equal for o in outcomes), report


def test_a_check_with_too_few_steps_for_a_replay_expects_none_and_says_so(capsys):
    """`--steps 2`: a loop replays a graph only after its first `GUARDED_CALLS` guarded steps, so a method that
    compiled to one graph with the eager tokens is as expected without replays, and the table says why (`-`
    and a line under it). With one step more than the guarded ones the replay is expected, and comes."""
    outcomes = check_static_decode.main(["--models", "tiny_llama", "--backend", "eager", "--steps", "2",
                                         "--methods", "full,streamingllm_rolling"])
    report = capsys.readouterr().out
    assert [o.path for o in outcomes] == ["compiled", "compiled"] and all(o.ok for o in outcomes), report
    assert [o.compiled_steps for o in outcomes] == [2, 1], report  # the rolling window's first step is eager
    assert all(o.replayed == 0 and not o.replays_expected for o in outcomes), report
    assert "all methods as expected" in report and "NOT as expected" not in report
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line.startswith(("full ", "streamingllm"))}
    assert rows["full"][7] == "-" and rows["streamingllm_rolling"][7] == "-", report
    assert (f"replays not expected for full, streamingllm_rolling: 1 or 2 compiled steps, and a decode loop replays "
            f"a graph only after its first {GUARDED_CALLS} guarded steps") in report
    steps = GUARDED_CALLS + 1
    outcomes = check_static_decode.main(["--models", "tiny_llama", "--backend", "eager", "--steps", str(steps),
                                         "--methods", "full"])
    report = capsys.readouterr().out
    assert outcomes[0].ok and outcomes[0].replays_expected and outcomes[0].replayed == 1, report
    assert outcomes[0].guarded == GUARDED_CALLS and "replays not expected" not in report, report
    # with steps enough, a compiled method that is not replayed is not as expected
    unreplayed = check_static_decode.Outcome("full", "compiled", graphs=1, compiled_steps=steps, guarded=steps)
    assert not unreplayed.ok
    assert check_static_decode.Outcome("full", "compiled", graphs=1, compiled_steps=GUARDED_CALLS,
                                       guarded=GUARDED_CALLS).ok


def test_inductor_compiles_the_two_stage_and_the_ragged_step_to_the_eager_tokens(capsys):
    outcomes = check_static_decode.main(["--models", "tiny_llama", "--backend", "inductor", "--steps", "16",
                                         "--methods", "rocketkv,adakv"])
    report = capsys.readouterr().out
    assert [o.path for o in outcomes] == ["compiled", "compiled"] and all(o.ok for o in outcomes), report
    assert all(o.max_logit_diff < 1e-4 for o in outcomes), report


def test_a_bfloat16_step_compiles_with_inductor_and_rounds_as_the_eager_step(capsys):
    """bfloat16 is the CPU default where the CPU has bf16 instructions: its linear layers are then pre-blocked
    oneDNN weights, which inductor must take through kvbench's opaque op (it used to fail and fall back to eager),
    and its fused kernels must round between ops as eager does (SparQ's approximate scores otherwise tie
    differently: a logit 0.9 away)."""
    outcomes = check_static_decode.main(["--models", "tiny_llama", "--backend", "inductor", "--steps", "8",
                                         "--dtype", "bfloat16", "--methods", "sparq"])
    report = capsys.readouterr().out
    assert [o.path for o in outcomes] == ["compiled"] and all(o.ok for o in outcomes), report
    assert outcomes[0].max_logit_diff < 0.05, report  # a few bf16 steps of logits of magnitude ~4


@pytest.mark.parametrize("lens,caps", [([40, 40, 40], [256, 256, 256]), ([7, 1, 200], [9, 70, 300])])
def test_static_decode_attention_is_the_reference_on_uniform_and_ragged_layouts(lens, caps):
    gen = torch.Generator().manual_seed(sum(lens))
    dim, group = 16, 3
    starts = [sum(caps[:h]) for h in range(len(caps))]
    keys, values = torch.randn(sum(caps), dim, generator=gen), torch.randn(sum(caps), dim, generator=gen)
    q = torch.randn(len(lens), group, dim, generator=gen)
    fill = torch.tensor(lens)
    if len(set(caps)) == 1:
        out = static_decode_attention(q, keys, values, 0.25, fill, caps[0], None, None)
    else:
        row_head = torch.repeat_interleave(torch.arange(len(caps)), torch.tensor(caps))
        row_slot = torch.arange(sum(caps)) - torch.tensor(starts)[row_head]
        out = static_decode_attention(q, keys, values, 0.25, fill, None, row_head, row_slot)
    torch.testing.assert_close(out, decode_attention_reference(q, keys, values, 0.25, starts, lens), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method,budget,ragged", [("snapkv", 48, False), ("adakv", 48, True), ("full", 0, False)])
def test_the_static_layout_holds_the_same_rows_and_bytes_and_gives_them_back(tiny_llama, method, budget, ragged):
    session = Session(tiny_llama, build_method(method, **({"window": 8} if method != "full" else {})), budget or 10**6)
    session.prefill(random_ids(300, seed=3), compress=True)
    cache = session.cache
    before = [(layer.lengths(), layer.head_view()) for layer in cache.layers]
    held, peak = cache.kv_bytes(), cache.kv_peak_bytes
    cache.make_static(20, 0, tiny_llama.model.config.num_attention_heads, ragged=ragged)
    for layer, (lens, view) in zip(cache.layers, before):
        static = layer.head_view()
        assert layer.static.uniform is not ragged
        assert static.width % CAPACITY_BUCKET == 0 and static.width >= max(lens) + 20
        assert static.lengths.tolist() == lens
        for h, n in enumerate(lens):  # each head's rows, in order, at its first slots
            assert torch.equal(static.keys[h, :n], view.keys[h, :n]) and torch.equal(static.positions[h, :n],
                                                                                      view.positions[h, :n])
        if ragged:  # no head padded to the longest: the rows are each head's own plus the append room
            assert layer.buffers["keys"].shape[0] < len(lens) * static.width
    cache.make_dynamic()
    assert cache.kv_bytes() == held and cache.kv_peak_bytes == peak
    assert [layer.lengths() for layer in cache.layers] == [lens for lens, _ in before]


def test_decode_eviction_overwrites_slots_and_comes_back_in_position_order(tiny_llama, eager_backend):
    """StreamingLLM's rolling window on the static layout writes each new token into the slot it evicted; the
    layer it leaves is exactly the eager layer (rows in position order)."""
    ids = random_ids(200, seed=4)

    def run(decoder):
        session, _ = greedy_decode(tiny_llama, build_method("streamingllm", decode_every=1), 40, ids, 12, decoder)
        slots = session.cache.layers[0].head_view().positions.clone() if session.cache.is_static else None
        session.end_decode()
        return session, slots

    eager, _ = run(None)
    static, slots = run(compiled.decoder_for(tiny_llama))
    assert static.static_steps == 11  # the loop's first step is eager (it may drop several tokens per head)
    kept = slots[0][slots[0] >= 0]
    assert not bool((kept[1:] > kept[:-1]).all())  # overwritten in place: no longer in position order
    for a, b in zip(eager.cache.layers, static.cache.layers):
        assert a.lengths() == b.lengths()
        torch.testing.assert_close(b.head_view().keys, a.head_view().keys)
        assert torch.equal(b.head_view().positions, a.head_view().positions)
    assert eager.cache.evictions() == static.cache.evictions() and eager.cache.kv_bytes() == static.cache.kv_bytes()


def test_the_repeated_kv_baseline_holds_the_releases_capacity_and_full_a_bucket(tiny_llama, eager_backend):
    """The repeated-K/V baseline attends every slot of its capacity, masked, as RocketKV's gpt-fast baseline attends
    its `max_seq_length` (prompt plus new tokens): its compiled loop holds that rounded up to 256 rows, where the
    geometric capacity would make it read up to twice that at every step. `full` keeps the geometric capacity
    (its CUDA kernel reads each head's held rows only). Tokens are the eager path's either way."""
    ids = random_ids(600, seed=5)
    widths, tokens = {}, {}
    for repeat in (None, True):
        method = build_method("full", repeat_kv=repeat)
        eager, last = greedy_decode(tiny_llama, method, 10**6, ids, 6, None)
        eager.end_decode()
        session, token = greedy_decode(tiny_llama, method, 10**6, ids, 6, compiled.decoder_for(tiny_llama))
        widths[repeat] = session.cache.layers[0].static.width
        tokens[repeat] = (token, last)
        assert session.static_steps == 6
        session.end_decode()
    needed = 600 + 6 + 1  # the prompt, the loop's steps and the token before them
    assert widths[True] == 768 == bucketed(needed, growth=1) and widths[None] == 1024 == bucketed(needed)
    assert all(a == b for a, b in tokens.values())


@pytest.mark.parametrize("steps", [5, 13])  # fewer decode steps than RocketKV's window of 8, and more
def test_the_static_query_window_is_a_ring_that_comes_back_as_the_eager_window(tiny_llama, eager_backend, steps):
    """The static layout keeps the last queries in a ring (each step overwrites the oldest entry, at
    `query_slot`); while static, a reader gets them oldest first (`recent_queries`), and leaving the layout
    puts them back in order: the window RocketKV's next turn re-compresses with is the eager one (its positions
    exactly, its queries up to the compiled step's rounding)."""
    ids = random_ids(150, seed=6)

    def run(decoder):
        session, _ = greedy_decode(tiny_llama, build_method("rocketkv", window=8), 64, ids, steps, decoder)
        layer = session.cache.layers[0]
        during = [t.clone() for t in layer.recent_queries(3)] if session.cache.is_static else None
        slot = int(layer.query_slot) if layer.query_slot is not None else None
        session.end_decode()
        return session, during, slot

    eager, _, _ = run(None)
    static, during, slot = run(compiled.decoder_for(tiny_llama))
    assert slot == (static.static_steps % 8) and slot != 0  # the ring has turned
    ordered = eager.cache.layers[0]
    torch.testing.assert_close(during[0], ordered.queries[:, -3:], atol=1e-6, rtol=1e-6)
    assert torch.equal(during[1], ordered.query_positions[-3:])
    for a, b in zip(eager.cache.layers, static.cache.layers):
        assert b.query_slot is None and torch.equal(b.query_positions, a.query_positions)
        torch.testing.assert_close(b.queries, a.queries, atol=1e-6, rtol=1e-6)


def test_each_decoder_compiles_and_runs_its_own_graphs(tiny_llama):
    """A decoder never runs another decoder's graph. Dynamo keys compiled code by the function's code object, and
    a decoder drops the guards on its model's modules: were the code object shared by every `CompiledDecoder`, a
    decoder of another model whose cache has the same shapes (another tiny Llama with biases, say) would pass
    the remaining guards and run a graph without its biases. So each decoder compiles its own copy of the code.
    Two decoders of one model and backend show it: each compiles its own graph."""
    ids = random_ids(120, seed=6)

    def steps(decoder):
        session, token = greedy_decode(tiny_llama, build_method("quest"), 32, ids, 3, decoder)
        session.end_decode()
        return session.compiles, token

    first, second = (steps(compiled.CompiledDecoder(tiny_llama, "eager")) for _ in range(2))
    assert first[0] == 1 and second[0] == 1  # each compiled its graph once, on its first step
    assert first[1] == second[1]


def test_a_decode_loop_replays_its_graph_after_two_guarded_calls_and_keeps_nothing_after_it(tiny_llama):
    """The first step compiles, the next two go through dynamo's guards (noted, then compared), every later
    step of the loop replays the graph; the tokens are the eager path's. After the loop neither the session nor
    the decoder holds the loop's tensors (a replay keeps the cache's buffers alive)."""
    decoder = compiled.CompiledDecoder(tiny_llama, "eager")
    ids = random_ids(120, seed=6)
    eager, eager_token = greedy_decode(tiny_llama, build_method("quest"), 32, ids, 10, None)
    session, token = greedy_decode(tiny_llama, build_method("quest"), 32, ids, 10, decoder)
    assert token == eager_token and session.static_steps == 10
    assert session.static_loop.replayed == 10 - GUARDED_CALLS  # the first steps compile, note, compare
    session.end_decode()
    assert session.static_loop is None and session.replayed_steps == 10 - GUARDED_CALLS
    assert decoder._recorder.last is None
    again, _ = greedy_decode(tiny_llama, build_method("quest"), 32, ids, 10, decoder)  # compiled: 2 guarded calls
    assert again.compiles == 0 and again.static_loop.replayed == 10 - (GUARDED_CALLS - 1)


class CapturedOnCpu:
    """A CUDA graph's semantics on a CPU, for `kvbench.engine.replay.CudaGraphCapture`'s place: capturing runs
    nothing (the graph runs once to learn its outputs, then every tensor it was handed is put back as it was), and
    each replay writes the graph's outputs into the same tensors, which the caller must copy before the next."""

    stream = None  # guarded calls on the current stream

    def __init__(self):
        self.captures = self.replays = 0

    def __call__(self, graph, args):
        self.captures += 1
        saved = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        outputs = [o.clone() for o in graph(*args)]
        for arg, before in zip(args, saved):
            if isinstance(arg, torch.Tensor):
                arg.copy_(before)
        capture = self

        class Graph:
            def replay(self):
                capture.replays += 1
                for fixed, new in zip(outputs, graph(*args)):
                    fixed.copy_(new)

        return Graph(), outputs


def test_a_loop_replays_a_captured_graph_as_cuda_does(tiny_llama, monkeypatch):
    """The CUDA path's bookkeeping on a CPU (`CapturedOnCpu` for the CUDA graph): one capture per loop after two
    guarded calls, the cache untouched by the capture, and every replayed step's logits its own (the captured
    output is overwritten by the next replay): each step's logits and the tokens are the eager path's."""
    decoder = compiled.CompiledDecoder(tiny_llama, "eager")
    capture = CapturedOnCpu()
    monkeypatch.setattr(decoder, "_capture", capture)
    ids = random_ids(120, seed=6)

    def decode(decoder):
        session = Session(tiny_llama, build_method("snapkv", window=8), 32)
        logits, _ = session.prefill(ids, compress=True)
        session.decoder = decoder
        session.begin_decode(10)
        steps = [logits]
        for _ in range(10):
            steps.append(session.step(int(steps[-1].argmax())))
        return session, steps

    eager, eager_steps = decode(None)
    session, steps = decode(decoder)
    assert (capture.captures, capture.replays, session.static_loop.replayed) == (1, 7, 7)
    for mine, theirs in zip(steps, eager_steps):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    session.end_decode()
    eager.end_decode()
    assert session.cache.kv_bytes() == eager.cache.kv_bytes()
    assert session.cache.stats.read_elements == eager.cache.stats.read_elements


class PooledCudaApi:
    """torch.cuda's graph API as the caching allocator keeps its pools (torch 2.11): a pool lives while a graph
    captured into it lives; a capture into a pool whose graphs were all freed fails the allocator's assertion (and,
    on a GPU, leaves it recording into the pool). Capturing runs nothing here: the test's graphs are pure."""

    def __init__(self):
        self.users: dict[int, int] = {}  # pool -> live graphs captured into it
        self.freed: set[int] = set()
        self.next_pool, self.captures = 0, 0
        api = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                if pool is None:
                    api.next_pool += 1
                    pool = ("private", api.next_pool)
                elif pool in api.freed:
                    raise RuntimeError('it->second->use_count > 0 INTERNAL ASSERT FAILED at "CUDACachingAllocator.cpp"')
                self.pool = pool
                api.users[pool] = api.users.get(pool, 0) + 1

            def capture_end(self):
                api.captures += 1

            def __del__(self):
                api.users[self.pool] -= 1
                if api.users[self.pool] == 0:
                    api.freed.add(self.pool)

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        self.CUDAGraph, self.Stream = Graph, Stream
        self.current_stream = lambda device=None: Stream()
        self.graph_pool_handle = lambda: (api.next_pool + 1000,)

    @staticmethod
    def stream(stream):
        import contextlib

        return contextlib.nullcontext()


def test_a_capture_after_the_last_loops_graphs_were_freed_succeeds(monkeypatch):
    """Each decode loop's CUDA graph is freed with its loop; the next loop (the next sample, method or length) must
    capture again. With one pool token shared by every capture, the second capture failed on an H100 (torch 2.11)
    and every capture, compile and random draw after it in the process (docs/journal/gpu.md, section 6): each graph now has
    its own pool. After a failed capture, nothing more is captured (its reason is kept)."""
    api = PooledCudaApi()
    for name in ("CUDAGraph", "Stream", "current_stream", "graph_pool_handle", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(api, name))
    capture = CudaGraphCapture(torch.device("cuda"))
    x = torch.zeros(3)
    for _ in range(3):  # three loops one after another, each freeing its graph before the next captures
        graph, outputs = capture(lambda t: (t + 1,), (x,))
        assert torch.equal(outputs[0], x + 1)
        del graph
    assert api.captures == 3 and capture.failed is None

    def refused(t):
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError):
        capture(refused, (x,))
    assert api.captures == 4 and "not permitted" in capture.failed  # the capture was ended all the same
    with pytest.raises(RuntimeError, match="an earlier capture in this process failed"):
        capture(lambda t: (t + 1,), (x,))
    assert api.captures == 4


def test_a_step_that_reads_a_new_tensor_every_step_is_not_replayed_and_warns_once(tiny_llama, monkeypatch, caplog):
    """A replay reads the tensors its graph was first handed: a step that reads a tensor made anew at every step
    (here: the token, were it not written in place) must keep its guarded calls, with one warning line per
    method, and the eager tokens."""

    def new_token_tensor(self, token, position):
        self.token = torch.tensor([[token]])
        self.position.fill_(position)

    monkeypatch.setattr(StepInputs, "set", new_token_tensor)
    decoder = compiled.CompiledDecoder(tiny_llama, "eager")
    ids = random_ids(120, seed=6)
    _, eager_token = greedy_decode(tiny_llama, build_method("snapkv", window=8), 32, ids, 8, None)
    method = build_method("snapkv", window=8)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            session, token = greedy_decode(tiny_llama, method, 32, ids, 8, decoder)
            session.end_decode()
            assert token == eager_token and session.replayed_steps == 0 and session.static_steps == 8
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "reads tensors that change from step to step" in warnings[0], warnings


def test_a_replay_that_is_not_the_same_graph_or_returns_no_output_of_it_is_refused():
    graph, other = (lambda *args: (args[0] + 1,)), (lambda *args: (args[0] + 1,))
    buffer, logits = torch.zeros(2), torch.ones(2)
    for first, second, why in (
        (GraphCall(graph, (buffer,), (logits,)), GraphCall(other, (buffer,), (logits,)), "change from step to step"),
        (GraphCall(graph, (buffer, 3), (logits,)), GraphCall(graph, (buffer, 4), (logits,)), "change from step"),
        (GraphCall(graph, (buffer,), (logits,)), GraphCall(graph, (buffer,), (torch.ones(2),)), "not one of its"),
    ):
        loop = LoopReplays(torch.device("cpu"))
        assert loop.note(False, first, logits, compiled=False) is None
        assert why in loop.note(False, second, logits, compiled=False) and loop.replay(False) is None
    loop = LoopReplays(torch.device("cpu"))
    call = GraphCall(graph, (buffer,), (logits,))
    assert loop.note(True, call, logits, compiled=True) is None and loop.note(True, call, logits, False) is None
    assert loop.note(True, call, logits, compiled=False) is None  # the same graph on the same tensors: replayed
    assert torch.equal(loop.replay(True), buffer + 1) and loop.replay(False) is None and loop.replayed == 1


def test_top_page_tokens_with_device_lengths_over_the_capacity_are_the_eager_tokens():
    gen = torch.Generator().manual_seed(0)
    for length, page, k in ((103, 8, 40), (96, 8, 40), (50, 16, 49)):
        pages = -(-length // page)
        scores = torch.randn(2, pages, generator=gen)
        capacity = torch.cat([scores, torch.full((2, 9), float("-inf"))], dim=1)  # the static layout's pages
        eager = top_page_tokens(scores, page, length, k)
        static = top_page_tokens(capacity, page, torch.tensor([length, length]), k)
        assert torch.equal(static, eager)


@pytest.mark.parametrize("anchor", ANCHORS)
def test_keydiff_scores_over_the_valid_slots_equal_the_scores_of_those_keys(anchor):
    keys = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(1))
    valid = torch.arange(64)[None, :] < torch.tensor([[40], [40]])
    padded = torch.cat([keys, torch.full((2, 24, 8), 7.0)], dim=1)
    torch.testing.assert_close(keydiff_scores(padded, anchor, valid=valid)[:, :40], keydiff_scores(keys, anchor),
                               atol=1e-4, rtol=1e-5)


def test_records_say_which_path_ran_and_why(tiny_llama, eager_backend):
    sample = kv_sample(2)
    auto = run_sample(tiny_llama, build_method("quest"), 64, sample, EngineConfig())  # auto on CPU: eager
    assert (auto["decode_path"], auto["decode_path_reason"], auto["decode_compiles"]) == ("eager", None, 0)
    on = run_sample(tiny_llama, build_method("quest"), 64, sample, EngineConfig(compile=True))
    assert on["decode_path"] == "compiled" and on["decode_compiles"] >= 1 and on["decode_compile_s"] > 0
    assert on["decode_replayed_steps"] > 0 and auto["decode_replayed_steps"] == 0
    assert [t["prediction"] for t in on["turns"]] == [t["prediction"] for t in auto["turns"]]
    host = run_sample(tiny_llama, build_method("infllm"), 64, sample, EngineConfig(compile=True))
    assert host["decode_path"] == "eager" and "host" in host["decode_path_reason"]
    # random eviction draws from the sample's host generator: at the prompt's end only, its decoding compiles
    drawn = run_sample(tiny_llama, build_method("random"), 64, sample, EngineConfig(compile=True))
    assert drawn["decode_path"] == "compiled"
    stepwise = run_sample(tiny_llama, build_method("random", decode_every=1), 64, sample, EngineConfig(compile=True))
    assert stepwise["decode_path"] == "eager" and "generator" in stepwise["decode_path_reason"]
    # a method that evicts while decoding takes each loop's first step eagerly: with two new tokens (one decode
    # step) nothing is left to compile, and the record says so rather than nothing
    short = kv_sample(2)
    short.meta["min_new_tokens"] = 2
    for turn in short.turns:
        turn.max_new_tokens = 2
    first_only = run_sample(tiny_llama, build_method("streamingllm", decode_every=1), 64, short,
                            EngineConfig(compile=True, nll=False))
    assert (first_only["decode_path"], first_only["decode_compiles"]) == ("eager", 0)
    assert "first step runs eagerly" in first_only["decode_path_reason"]


def test_a_step_that_fails_to_compile_falls_back_to_eager_with_one_warning(tiny_llama, monkeypatch, caplog):
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    lm_decoder = compiled.CompiledDecoder(tiny_llama, "eager")

    def broken(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("a graph break")

    monkeypatch.setattr(lm_decoder, "_compiled", broken)
    monkeypatch.setattr(compiled, "decoder_for", lambda lm, backend=None: lm_decoder)
    monkeypatch.setattr("kvbench.engine.sample.decoder_for", lambda lm, backend=None: lm_decoder)
    sample = kv_sample(1)
    eager = run_sample(tiny_llama, build_method("snapkv", window=8), 48, sample, EngineConfig())
    with caplog.at_level(logging.WARNING):
        fallen = run_sample(tiny_llama, build_method("snapkv", window=8), 48, sample, EngineConfig(compile=True))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "compile" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert fallen["decode_path"] == "eager" and fallen["decode_path_reason"].startswith("compile failed")
    assert fallen["turns"][0]["prediction"] == eager["turns"][0]["prediction"] and fallen["nll"] == eager["nll"]


def test_engine_compile_takes_auto_true_or_false():
    assert compiled.wants_compile("auto", torch.device("cpu")) is False
    assert compiled.wants_compile("auto", torch.device("cuda")) is True
    assert compiled.wants_compile(True, torch.device("cpu")) is True
    with pytest.raises(KVBenchError, match="engine.compile"):
        compiled.wants_compile("yes", torch.device("cpu"))


def test_the_latency_benchmark_decodes_every_method_on_both_paths(eager_backend, capsys):
    """A smoke run of scripts/bench_decode_latency.py --compile on the tiny model: it drives the engine's own
    prefill and decode step, so a change of their signatures breaks it (timings are not checked)."""
    bench_decode_latency.main(["--model", "tiny_llama", "--length", "300", "--budget", "32", "--methods",
                               "full,quest,exact_topk", "--steps", "2", "--warmup", "1", "--rounds", "1", "--compile"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    # a timed row starts 'method path ms/token'; a compiled run that fell back prints 'method compiled ran eagerly'
    ran = {(row[0], row[1]) for row in rows if len(row) > 2 and row[1] in ("eager", "compiled")
           and row[2].replace(".", "").isdigit()}
    assert ran == {(m, p) for m in ("full", "quest", "exact_topk") for p in ("eager", "compiled")}, rows


@pytest.mark.parametrize("impl", ["reference", "operator"])
def test_held_tokens_first_is_the_stable_sort_of_the_past_mask(impl, monkeypatch):
    """The first k after a stable sort of the past mask: in that order by the CPU's reference; as the same set
    by the stable top-k operator (CUDA's rule, the launch interpreted)."""
    import kvbench.kernels.stable_topk as stable_topk_module

    if impl == "operator":
        monkeypatch.setattr(stable_topk_module, "triton_launchable", lambda *tensors: True)
        monkeypatch.setattr(stable_topk_module.FALLBACK, "failed", [])
    gen = torch.Generator().manual_seed(3)
    for heads, n, k in ((1, 1, 1), (3, 17, 9), (4, 64, 64), (2, 100, 37), (8, 1056, 1000)):
        tokens = torch.randint(0, 1000, (heads, n), generator=gen)
        for share in (0.0, 0.3, 1.0):
            past = torch.rand(heads, n, generator=gen) < share
            stable = tokens.gather(-1, torch.sort(past.to(torch.uint8), dim=-1, stable=True).indices)[:, :k]
            got = held_first(tokens, past, k)
            if impl == "reference":
                assert torch.equal(got, stable)
            else:  # the same entries, by position in `tokens`
                assert torch.equal(got.sort(-1).values, stable.sort(-1).values)
    assert not stable_topk_module.FALLBACK.failed
