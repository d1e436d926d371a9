"""The compiled decode step (`engine.compile`): one decode step of a session on the static layout, compiled once
per point with `torch.compile(fullgraph=True, dynamic=False)`, then replayed without dynamo (a CUDA graph on a GPU).

On the static layout (`kvbench.cache.static`) a step reads no Python number that changes from one step to the
next: the token and its position come in as tensors, the cache's buffers are written in place at device
positions, its counters are device tensors. So the first step traces the model's forward with the method's
hooks (selection, eviction, accounting) into one graph, and every later step of the sample, and every sample
whose capacity falls in the same bucket, runs it. What a graph depends on is the layout's shape (the
bucketed capacity, uniform or ragged), the method's settings and the plan's shape parameters (a top-k's k, a
fixed page size): a new value of these compiles a new graph, which the record counts (`decode_compiles`). A plan
value derived from the prompt length is no shape: Quest's default page, HSA's and RocketKV's page and estimate
dimensions and SparQ's r are runtime inputs (`kvbench.methods.common.pages.RuntimePage`,
`kvbench.methods.common.dims`; over 12 prompt lengths of 1K-8K, 4 graphs each, one per capacity, where Quest
compiled 12, HSA 10 and SparQ 9). Within a
decode loop, once two guarded calls have shown that the loop's steps run one graph on the same tensors, the
later steps call that graph directly, skipping dynamo's guards: on CUDA as one CUDA graph captured per loop and
replayed (`kvbench.engine.replay`; records count them, `decode_replayed_steps`).

The token choice stays in the decode loop, which reads the token at every step anyway for its stop rules (EOS
masked before `min_new_tokens`, stop strings): one argmax over the returned logits and an 8-byte read, or a
sampled sample's seeded draw on the host (`kvbench.engine.decoding`), so both decodings share one graph. Calls
that compiled are timed as `decode_compile_s`, not as decode steps.

`engine.compile`: `auto` compiles on CUDA and stays eager on CPU (where the eager path is the default: stock
transformers' arithmetic, its decode forwards padded to a block of rows, `kvbench.engine.invariance`), `true` compiles wherever the method allows
(`Method.static_decode_blocker`), `false` never. Nothing about compiling stops a run: when the decoder cannot be
set up (an older torch, `torch.compile` refusing its arguments) or a step fails to trace or to compile (a graph
break under fullgraph, the backend's error), the point decodes on the eager path, with one warning line; every
record says which path ran (`decode_path`) and, when it is not the compiled one although compiling was asked
for, why (`decode_path_reason`).

Which torch: the step needs torch >= 2.5 (`MIN_TORCH`): inductor's `emulate_precision_casts` came in 2.5, and
`torch.compiler.is_compiling` and `torch.library.custom_op` before it. Below it `engine.compile` decodes eagerly
(one warning line). What came later is used where this torch has it and replaced where it has not, found by
looking (never by version number): dynamo's `guard_filter_fn` (2.8) drops the guards on the model's modules,
without it a guarded step checks them too (the same graphs, ~1.5 ms more per step on two CPU cores);
`torch.compile`'s own `recompile_limit` (2.12) sets each decoder's limit, without it dynamo's global limit is
raised. Each decoder's graphs are kept apart on every torch by a code object of its own (`_own_step`), not by
2.12's `isolate_recompiles`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import sys
import time
import traceback
import types
from typing import Any

import torch

from kvbench.core.devices import sync
from kvbench.core.errors import KVBenchError, one_line
from kvbench.engine.replay import CudaGraphCapture, GraphRecorder, LoopReplays
from kvbench.models import LoadedModel, cache_kwargs

log = logging.getLogger("kvbench")

COMPILE_SETTINGS = ("auto", True, False)

# One decoder serves every point of its model in a process (a grouped sweep compiles several graphs): dynamo's
# default limit of 8 graphs would silently fall back to eager past the eighth. The limit counts per code object,
# so each decoder (`_own_step`) has its own.
RECOMPILE_LIMIT = 256

# The oldest torch the compiled step runs on (see the module's docstring); only named in the reason a record gives
MIN_TORCH = "2.5"

# Why a model placed through `model.device_map` decodes eagerly: a step whose layers live on several devices (or are
# swapped in by accelerate's offload hooks, Python that moves weights) is not shown to trace as one graph, nor a
# CUDA graph to replay across devices; the record says so (`decode_path_reason`).
SHARDED_REASON = ("layer-sharded model (model.device_map): the compiled step is not shown to work across devices "
                  "or offload hooks")


def wants_compile(setting: Any, device: torch.device) -> bool:
    """Whether `engine.compile` asks for the compiled decode step on `device` (auto: on CUDA only)."""
    if setting not in COMPILE_SETTINGS:
        raise KVBenchError(f"engine.compile={setting!r}: expected auto, true or false")
    return device.type == "cuda" if setting == "auto" else bool(setting)


def missing_features(backend: Any) -> list[str]:
    """What this torch lacks of what the compiled step needs (torch >= `MIN_TORCH`), by name; empty when nothing.
    Looked up, not inferred from the version: a build between releases has what it has."""
    needed = {
        # kvbench's kernels trace their references when compiling, and call their own kernels eagerly
        "torch.compiler.is_compiling": hasattr(torch.compiler, "is_compiling"),
        # the split-K decode attention is one operator of the graph, with a fake implementation for tracing
        "torch.library.custom_op": hasattr(torch.library, "custom_op"),
    }
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        # without it inductor's fused bf16 kernels round otherwise than eager, and tokens change (see _compile)
        needed["torch._inductor.config.emulate_precision_casts"] = hasattr(inductor_config, "emulate_precision_casts")
    return [name for name, present in needed.items() if not present]


def describe(exc: BaseException) -> str:
    """`kvbench.core.errors.one_line`, without the type for a `CompileFailed` (its message is a description)."""
    return str(exc) if isinstance(exc, CompileFailed) else one_line(exc)


def _raise_dynamo_limit(*names: str) -> None:
    """Raise dynamo's config limit to `RECOMPILE_LIMIT`, under the first of `names` this torch has (2.7 renamed
    `cache_size_limit` to `recompile_limit`, and the accumulated one likewise)."""
    config = torch._dynamo.config
    name = next(name for name in names if hasattr(config, name))
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def _decode_step(decoder: "CompiledDecoder", cache: Any, step_context: Any, token: torch.Tensor,
                 position: torch.Tensor) -> torch.Tensor:
    """One decode step of `decoder`'s model, the function compiled (a copy per decoder: `_own_step`)."""
    cache.static_position = position.view(1)
    out = decoder.lm.model(input_ids=token, position_ids=position, **{decoder.cache_argument: cache},
                           use_cache=True, logits_to_keep=1, kvbench_steps=[step_context])
    return out.logits[0, -1].float()


_copies = itertools.count()


def _own_step(decoder: "CompiledDecoder") -> tuple[types.MethodType, types.CodeType]:
    """`_decode_step` bound to `decoder`, through a code object of its own, and that code object.

    Dynamo keeps the graphs it compiles on the code object it traced, and picks one by its guards. A decoder
    drops the guards on its model's modules (`guard_filter_fn`), so with one code object for all decoders, a
    decoder of another model whose cache has the same shapes would pass the remaining guards and run the first
    decoder's graph (another tiny Llama with biases would run one without them). A closure made per decoder would
    not help: closures of one `def` share its code object. A copy of the code object, renamed, is a new one: its
    graphs, and its count against the recompile limits, belong to this decoder alone."""
    code = _decode_step.__code__.replace(co_name=f"_decode_step_{next(_copies)}")
    step = types.FunctionType(code, _decode_step.__globals__, code.co_name)
    return types.MethodType(step, decoder), code


def _compile_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean a step failed to trace or compile (nothing of it ran): dynamo's own (graph
    breaks under fullgraph, `BackendCompilerFailed` and inductor's `InductorError` wrapping the backend's error),
    the recompile limit hit under fullgraph, inductor's error where it is not dynamo's, and Triton's
    `CompilationError` (inductor compiles a graph's kernels before it runs: a kernel Triton refuses stops the
    compile). Looked up in the modules already imported: one not imported raised nothing."""
    found: list[type[BaseException]] = [torch._dynamo.exc.TorchDynamoException]
    for module, name in (("torch._dynamo.exc", "FailOnRecompileLimitHit"), ("torch._inductor.exc", "InductorError"),
                         ("triton.compiler.errors", "CompilationError")):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def raised_compiling(exc: BaseException) -> bool:
    """Whether `exc`, raised by a compiled step, came from tracing or compiling it, before any of it ran (the cache
    is then as it was, and the step can run eagerly instead): it, or an exception it wraps, is a compile error
    (`_compile_errors`), or it was raised inside dynamo's conversion of the frame (dynamo re-raises some errors
    of its own and of the backend unwrapped: an AssertionError, an IndexError). An exception from running a
    compiled graph is neither; that graph may have written the cache in place, so it is not retried eagerly."""
    errors = _compile_errors()
    conversion = torch._dynamo.convert_frame.__file__
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, errors) or any(frame.f_code.co_filename == conversion
                                              for frame, _ in traceback.walk_tb(current.__traceback__)):
            return True
        current = current.__cause__ or current.__context__ or getattr(current, "inner_exception", None)
    return False


class CompiledDecoder:
    """The compiled decode step of one model: `step(session, token, step_context)` runs one decode step of
    `session` (whose cache is in the static layout) and returns its float32 logits. One per model, backend and
    process (`decoder_for`): its graphs are keyed by what they depend on (layout shape, method settings, plan), so
    the points of a grouped run share it, each compiling its own graphs.

    A decoder that cannot be set up is `unavailable` (why, as a record's reason): every method's steps then run
    eagerly (`failure`), and its construction logged one warning line."""

    def __init__(self, lm: LoadedModel, backend: Any = "inductor"):
        self.lm = lm
        self._failures: dict[int, str] = {}  # id(method) -> why its step did not compile (it then decodes eagerly)
        self._unreplayed: set[int] = set()  # id(method) of the methods whose loops kept guarded calls (warned once)
        self.unavailable: str | None = None
        self._capture: CudaGraphCapture | None = None
        if lm.sharded:
            self.unavailable = SHARDED_REASON
            return
        try:
            self._compiled = self._compile(backend)
        except Exception as exc:  # noqa: BLE001 - whatever setting up the compile raises, the run decodes eagerly
            self.unavailable = f"compile failed: {describe(exc)}"
            log.warning("kvbench: the compiled decode step could not be set up (%s); decoding eagerly", describe(exc))
            return
        # on CUDA a loop's replayed steps are one captured CUDA graph; elsewhere the backend's graph called directly
        self._capture = CudaGraphCapture(lm.device) if lm.device.type == "cuda" else None

    def _compile(self, backend: Any) -> Any:
        missing = missing_features(backend)
        if missing:
            raise CompileFailed(f"torch {torch.__version__} lacks {', '.join(missing)} (the compiled decode step "
                                f"needs torch >= {MIN_TORCH})")
        accepted = inspect.signature(torch.compile).parameters
        limit = {"recompile_limit": RECOMPILE_LIMIT} if "recompile_limit" in accepted else {}
        if not limit:
            _raise_dynamo_limit("recompile_limit", "cache_size_limit")
        # the accumulated limit caps a code object's graphs of every guard set together (64 on older torches)
        _raise_dynamo_limit("accumulated_recompile_limit", "accumulated_cache_size_limit")
        options: dict[str, Any] = {}
        if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # 2.8, with the guard_filter_fn option
            # A decoder steps one model whose modules nothing changes after loading, and its graphs are its own
            # (`_own_step`). The ~7,000 guards dynamo would check on those modules at every guarded step (of
            # ~9,000 on SmolLM2; 1.4-1.9 ms of a step on two CPU cores) are dropped; the guards on the cache, the
            # method and the plan, which tell points apart, stay.
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        inner = backend
        if backend == "inductor":
            # Eager rounds every bf16/fp16 op's result; inductor's fused kernels keep float32 between ops unless
            # told to round as eager does. Without it a bf16 SparQ step picks other tokens than the eager step
            # (its approximate scores tie differently); with it the tiny models' bf16 steps are bitwise eager's.
            # No `triton.cudagraphs` (inductor's CUDA-graph trees, which check the graph's inputs at every call):
            # a decode loop's steps are captured and replayed by `kvbench.engine.replay` instead.
            inner = torch._TorchCompileInductorWrapper(None, {"emulate_precision_casts": True}, False)
        self._recorder = GraphRecorder(inner)
        self.cache_argument = next(iter(cache_kwargs(self.lm.model, None)))  # found once, outside the trace
        step, self.step_code = _own_step(self)
        return torch.compile(step, fullgraph=True, dynamic=False, backend=self._recorder, options=options, **limit)

    def failure(self, method: Any) -> str | None:
        return self.unavailable or self._failures.get(id(method))

    def record_failure(self, method: Any, reason: str) -> None:
        self._failures[id(method)] = reason

    def new_loop(self) -> LoopReplays:
        """The replay state of a session's decode loop on a new static layout (see `kvbench.engine.replay`)."""
        return LoopReplays(self.lm.device, self._capture)

    @torch.inference_mode()
    def step(self, session: Any, token: int, step_context: Any) -> tuple[torch.Tensor, float]:
        """One compiled decode step of `session`'s loop (`session.static_loop`): the logits and the seconds spent
        compiling in this call (0 when it ran a graph already compiled). A step whose graph the loop replays
        skips dynamo; others are guarded calls. Raises `CompileFailed` (the cache untouched) when the step fails
        to trace or compile."""
        loop = session.static_loop
        loop.inputs.set(token, session.position)
        key = step_context.evict  # an evicting step is another graph
        logits = loop.replay(key)
        if logits is not None:
            return logits, 0.0
        device = self.lm.device
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        self._recorder.take()
        sync(device)
        start = time.perf_counter()
        try:
            stream = self._capture.stream if self._capture is not None else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None:  # guarded calls on the capture stream: lazy set-up happens before capture
                    stream.wait_stream(torch.cuda.current_stream(device))
                logits = self._compiled(session.cache, step_context, loop.inputs.token, loop.inputs.position)
        except Exception as exc:
            self._recorder.take()  # a failed call's tensors are not kept
            if not raised_compiling(exc):
                raise
            raise CompileFailed(describe(exc)) from exc
        sync(device)
        compile_s = time.perf_counter() - start
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
        why = loop.note(key, self._recorder.take(), logits, compiled)
        if why is not None and id(session.method) not in self._unreplayed:
            self._unreplayed.add(id(session.method))
            log.warning("kvbench: the compiled decode step of %s is not replayed (%s); its steps go through "
                        "dynamo's guards", getattr(session.method, "name", "full"), why)
        return logits, compile_s if compiled else 0.0


class CompileFailed(RuntimeError):
    """The decode step could not be compiled (a graph break under fullgraph, a backend error)."""


# torch.compile's backend. Tests and scripts/check_static_decode.py set "eager" or "aot_eager", which trace the
# same whole step (graphs, breaks and recompiles are dynamo's) without inductor's code generation
BACKEND = "inductor"


def decoder_for(lm: LoadedModel, backend: str | None = None) -> CompiledDecoder:
    """The process's compiled decode step for `lm` (created on first use, kept with the model)."""
    backend = backend or BACKEND
    decoders = lm.model.__dict__.setdefault("_kvbench_decoders", {})
    if backend not in decoders:
        decoders[backend] = CompiledDecoder(lm, backend)
    return decoders[backend]
