"""The compiled decode step (`engine.compile`): one decode step of a session on the static layout, compiled once
per point with `torch.compile(fullgraph=True, dynamic=False)` and replayed at every step (CUDA graphs on a GPU).

On the static layout (`kvbench.cache.static`) a step reads no Python number that changes from one step to the
next: the token and its position come in as tensors, the cache's buffers are written in place at device
positions, its counters are device tensors. So the first step traces the model's forward with the method's
hooks (selection, eviction, accounting) into one graph, and every later step of the sample, and every sample
whose capacity falls in the same bucket, replays it. What a graph depends on is the layout's shape (the
bucketed capacity, uniform or ragged), the method's settings and the plan's shape parameters (a top-k's k, a
page size): a new value of these compiles a new graph, which the record counts (`decode_compiles`).

The greedy choice stays in the decode loop, which reads the token at every step anyway for its stop rules (EOS
masked before `min_new_tokens`, stop strings): one argmax over the returned logits and an 8-byte read. Calls
that compiled are timed as `decode_compile_s`, not as decode steps.

`engine.compile`: `auto` compiles on CUDA and stays eager on CPU (where the eager path is the exact default:
float32 records bitwise stock transformers), `true` compiles wherever the method allows
(`Method.static_decode_blocker`), `false` never. A compile that fails falls back to the eager path with one
warning line; every record says which path ran (`decode_path`) and, when it is not the compiled one although
compiling was asked for, why (`decode_path_reason`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvbench.core.devices import sync
from kvbench.core.errors import KVBenchError
from kvbench.models import LoadedModel, cache_kwargs

log = logging.getLogger("kvbench")

COMPILE_SETTINGS = ("auto", True, False)

# One decoder serves every point of its model in a process (a grouped sweep compiles several graphs): dynamo's
# default limit of 8 graphs would silently fall back to eager past the eighth.
RECOMPILE_LIMIT = 256


def wants_compile(setting: Any, device: torch.device) -> bool:
    """Whether `engine.compile` asks for the compiled decode step on `device` (auto: on CUDA only)."""
    if setting not in COMPILE_SETTINGS:
        raise KVBenchError(f"engine.compile={setting!r}: expected auto, true or false")
    return device.type == "cuda" if setting == "auto" else bool(setting)


class CompiledDecoder:
    """The compiled decode step of one model: `step(session, token, step_context)` runs one decode step of
    `session` (whose cache is in the static layout) and returns its float32 logits. One per model and process
    (`decoder_for`): its graphs are keyed by what they depend on (layout shape, method settings, plan), so the
    points of a grouped run share it, each compiling its own graphs."""

    def __init__(self, lm: LoadedModel, backend: str = "inductor"):
        self.lm = lm
        self._failures: dict[int, str] = {}  # id(method) -> why its step did not compile (it then decodes eagerly)
        # the accumulated limit is global (every decoder's graphs count against it); each decoder's own limit is
        # `recompile_limit`, counted apart from other decoders' graphs (isolate_recompiles)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, RECOMPILE_LIMIT)
        # A decoder steps one model whose modules nothing changes after loading, and its graphs are its own
        # (isolate_recompiles: a decoder of another model or backend never runs them). The ~7,000 guards dynamo
        # would check on those modules at every step (of ~9,000 on SmolLM2; 1.4-1.9 ms of a step on two CPU
        # cores) are dropped; the guards on the cache, the method and the plan, which tell points apart, stay.
        options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self.cuda_graphs = lm.device.type == "cuda" and backend == "inductor"
        if backend == "inductor":
            # Eager rounds every bf16/fp16 op's result; inductor's fused kernels keep float32 between ops unless
            # told to round as eager does. Without it a bf16 SparQ step picks other tokens than the eager step
            # (its approximate scores tie differently); with it the tiny models' bf16 steps are bitwise eager's.
            # On CUDA, `triton.cudagraphs` is what mode="reduce-overhead" sets (a mode and options exclude
            # each other in torch.compile).
            options.update({"emulate_precision_casts": True, "triton.cudagraphs": self.cuda_graphs})
        self._cache_argument = next(iter(cache_kwargs(lm.model, None)))  # found once, outside the trace
        self._compiled = torch.compile(self._step, fullgraph=True, dynamic=False, backend=backend, options=options,
                                       isolate_recompiles=True, recompile_limit=RECOMPILE_LIMIT)

    def _step(self, cache: Any, step_context: Any, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        cache.static_position = position.view(1)
        out = self.lm.model(input_ids=token, position_ids=position, **{self._cache_argument: cache},
                            use_cache=True, logits_to_keep=1, kvbench_steps=[step_context])
        return out.logits[0, -1].float()

    def failure(self, method: Any) -> str | None:
        return self._failures.get(id(method))

    def record_failure(self, method: Any, reason: str) -> None:
        self._failures[id(method)] = reason

    @torch.inference_mode()
    def step(self, session: Any, token: int, step_context: Any) -> tuple[torch.Tensor, float]:
        """One compiled decode step: the logits and the seconds spent compiling in this call (0 when it replayed
        a graph). Raises `CompileFailed` (the cache untouched) when the first trace or compile fails."""
        device = self.lm.device
        token_t = torch.tensor([[token]], device=device)
        position_t = torch.tensor([[session.position]], device=device)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        sync(device)
        start = time.perf_counter()
        try:
            logits = self._compiled(session.cache, step_context, token_t, position_t)
        except torch._dynamo.exc.TorchDynamoException as exc:  # raised while tracing or compiling, before running
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CompileFailed(f"{type(exc).__name__}: {first_line}") from exc
        sync(device)
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
        if self.cuda_graphs:
            logits = logits.clone()  # a CUDA-graph output is overwritten by the next replay
        return logits, (time.perf_counter() - start) if compiled else 0.0


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
