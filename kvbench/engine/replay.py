"""Replaying a compiled decode step without dynamo: the host work of a guarded call, skipped.

A guarded call of the compiled step (`torch.compile`'s frame) checks dynamo's guards on the cache, the method
and the plan before it runs its graph, and under inductor's CUDA graphs (cudagraph trees) checks the graph's
inputs too. On an H100 that was 0.6-0.8 ms of a 2.6 ms full step at 32K in which the GPU idled (docs/gpu, section
5): what kept the compiled step at 1.6x its bandwidth floor. gpt-fast avoids it by replaying the step's CUDA
graph directly; so does the compiled step here, once a decode loop shows that it may:

- torch.compile's backend is wrapped (`GraphRecorder`): each graph it compiles, when dynamo calls it, notes
  itself, the tensors dynamo handed it, and what it returned, on the decoder;
- in the static layout every tensor a step reads stays at one address for the whole decode loop: the cache's
  buffers and device counters (`KVBenchCache.make_static`), the model's weights, and the step's token and
  position, which the decoder writes into this loop's `StepInputs` instead of making new tensors;
- so when a loop's second guarded call of a graph key (a step's eviction flag: an evicting step is another
  graph) ran the same graph on the same tensors as its first, every later step of the loop with that key is the
  graph called directly (`StepReplay`): on CUDA a CUDA graph captured from it once and replayed (its output
  cloned: the next replay overwrites it), elsewhere the backend's compiled graph called with those tensors. A
  replay runs exactly the kernels a guarded call would, on the same tensors: records do not change.

What a replay skips besides the guards: the step's Python side effects, which dynamo re-applies after its
graph. The static step has none that a later step reads (its state is device tensors written in place; the
host's side, `KVBenchCache.static_advance`, runs outside the graph). Nor can a guard fail within a loop: what a
graph depends on (the layout's shape, the method's settings, the plan) is fixed when the loop's layout is made,
and the eviction flag is the key. A loop whose second call ran another graph, or handed it another tensor
(a method that makes a tensor per step, read by its step), keeps its guarded calls, with one warning line per
method; `tests/test_static_decode.py` replays every static method and checks its tokens, logits and decode
statistics against the eager path's. A capture that fails (an op CUDA graphs refuse) also leaves the loop's
steps guarded, with one warning line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvbench.core.errors import one_line

# The guarded calls a decode loop makes of a graph key before it replays the key's steps, at most: the call that
# compiles the graph, the next one (noted) and the one compared with it (`LoopReplays.note`); a loop of a graph
# compiled before (a later sample) makes two. A loop with no more steps of a key than this replays none of them.
GUARDED_CALLS = 3


@dataclass
class GraphCall:
    """One call of a compiled graph by dynamo: the graph, the tensors (and constants) it was handed, its outputs."""

    graph: Callable[..., Any]
    args: tuple[Any, ...]
    outputs: Any


class GraphRecorder:
    """torch.compile's backend: `inner` (a backend's name, resolved by dynamo, or a backend callable) compiles
    each graph, and every call of a compiled graph is noted in `last` (read and cleared by the decoder right after
    its guarded call, so that no call keeps a sample's cache alive)."""

    def __init__(self, inner: Any):
        from torch._dynamo.backends.registry import lookup_backend

        self.inner = lookup_backend(inner) if isinstance(inner, str) else inner
        self.last: GraphCall | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graph = self.inner(gm, example_inputs)

        def noted_graph(*args: Any) -> Any:
            outputs = graph(*args)
            self.last = GraphCall(graph, args, outputs)
            return outputs

        return noted_graph

    def take(self) -> GraphCall | None:
        call, self.last = self.last, None
        return call


class StepInputs:
    """The decode step's token and position, [1, 1] int64 tensors written in place before every step of a loop
    (a fill, no host-to-device copy of a new tensor): a replayed graph reads them where it read them first."""

    def __init__(self, device: torch.device):
        self.token = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self.position = torch.zeros(1, 1, dtype=torch.int64, device=device)

    def set(self, token: int, position: int) -> None:
        self.token.fill_(token)
        self.position.fill_(position)


class StepReplay:
    """One graph of a decode loop called without dynamo: with a `capture` (on CUDA, `CudaGraphCapture`), the
    graph's kernels captured once and replayed, the step's logits read from the captured output (`output`: which of
    the graph's outputs it is) and cloned, since the next replay overwrites it; without, the compiled graph called
    with the same tensors."""

    def __init__(self, call: GraphCall, output: int, capture: "Callable[..., tuple[Any, Any]] | None" = None):
        self.call, self.output = call, output
        self.graph = None
        if capture is not None:
            self.graph, outputs = capture(call.graph, call.args)
            self.captured = outputs[output]  # written by each replay; nothing ran while capturing

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.call.graph(*self.call.args)[self.output]
        self.graph.replay()
        return self.captured.clone()  # the next replay overwrites the captured output


class CudaGraphCapture:
    """Captures a compiled graph's kernels, called on its tensors, as one CUDA graph: on a side `stream` (capture
    cannot run on the default stream), each graph in its own memory pool, freed with the graph. Nothing runs
    while capturing. The decoder's guarded calls run on the same stream, so lazy set-up (cuBLAS handles,
    workspaces) happens before the first capture, as CUDA graphs require.

    Why not one pool for all of a decoder's graphs (a token from `torch.cuda.graph_pool_handle()`): the allocator
    frees a pool when the last graph captured into it is freed, and a later capture into the same token then fails
    an internal assertion (`use_count > 0`, torch 2.11 on an H100; docs/gpu, section 6) and leaves the allocator
    recording into the pool, so that every later capture, compile or random draw in the process failed too. A
    graph's own pool costs its intermediates for one token, freed with the loop that replays it. After a failed
    capture this object captures nothing more (`failed`): the process's CUDA state is not trusted again, and the
    decoder's later loops keep their guarded calls."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.failed: str | None = None

    def __call__(self, graph: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any]:
        if self.failed is not None:
            raise RuntimeError(f"an earlier capture in this process failed ({self.failed})")
        cuda_graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                cuda_graph.capture_begin(capture_error_mode="thread_local")
                try:
                    outputs = graph(*args)
                finally:
                    cuda_graph.capture_end()
        except Exception as exc:
            self.failed = one_line(exc)
            raise
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return cuda_graph, outputs


def _same_inputs(first: GraphCall, second: GraphCall) -> bool:
    """Whether two calls ran one graph on the same tensors (the same objects) and the same constants."""
    if first.graph is not second.graph or len(first.args) != len(second.args):
        return False
    return all(a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b
               for a, b in zip(first.args, second.args))


def _output_index(call: GraphCall, logits: torch.Tensor) -> int | None:
    """Which of the graph's outputs the guarded call returned as the step's logits (None: none of them is)."""
    outputs = call.outputs if isinstance(call.outputs, (tuple, list)) else (call.outputs,)
    return next((i for i, out in enumerate(outputs) if out is logits), None)


class LoopReplays:
    """The replays of one session's static decode loop: its `StepInputs`, and per graph key the first guarded
    call (`noted`), the replay, or why its steps stay guarded (`refused`)."""

    def __init__(self, device: torch.device, capture: "Callable[..., tuple[Any, Any]] | None" = None):
        self.capture = capture
        self.inputs = StepInputs(device)
        self.noted: dict[Any, GraphCall] = {}
        self.replays: dict[Any, StepReplay] = {}
        self.refused: dict[Any, str] = {}
        self.replayed = 0  # steps this loop replayed

    def replay(self, key: Any) -> torch.Tensor | None:
        """The step's logits, replayed; None when this key has no replay (the step goes through dynamo)."""
        replay = self.replays.get(key)
        if replay is None:
            return None
        self.replayed += 1
        return replay()

    def note(self, key: Any, call: GraphCall | None, logits: torch.Tensor, compiled: bool) -> str | None:
        """After a guarded call of `key` that returned `logits`: note it, or, on the second call that ran a graph
        already compiled, make the replay of the key's next steps. Why not, when it cannot be (warn once)."""
        if key in self.refused or key in self.replays:
            return None
        if call is None or compiled:  # a call that compiled (or saw no graph): the next warm call is noted
            self.noted.pop(key, None)
            return None
        first = self.noted.pop(key, None)
        if first is None:
            self.noted[key] = call
            return None
        output = _output_index(call, logits)
        if not _same_inputs(first, call) or output is None:
            why = ("its step reads tensors that change from step to step" if output is not None
                   else "its step's logits are not one of its graph's outputs")
            self.refused[key] = why
            return why
        try:
            self.replays[key] = StepReplay(call, output, self.capture)
        except Exception as exc:  # noqa: BLE001 - an op CUDA graphs refuse: the guarded calls still work
            why = f"capturing its CUDA graph failed: {one_line(exc)}"
            self.refused[key] = why
            return why
        return None
