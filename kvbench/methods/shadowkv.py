"""ShadowKV (Sun et al. 2024, arXiv 2410.21465; code bytedance/ShadowKV): low-rank pre-RoPE keys on the device,
values in host memory, and a sparse attention over the chunks whose landmarks score highest (CTKVR's baseline,
its §4.1.2).

When the compressed segment ends, per layer (the repo's `ShadowKVCache.prefill_kv_cache` and `get_svd`):

- the segment's keys, RoPE removed, all KV heads side by side `[n, H * D]`, are factored by a truncated SVD:
  U `[n, r]` and S V^T `[H, r, D]` stay on the device (model dtype), the exact keys of every non-resident row
  are freed (`layer.retain`);
- after `sink_tokens` (the repo has none: 0), the tokens are cut into chunks of `chunk_size`; the last
  `local_chunks` chunks plus the remainder of the division stay resident (the local window), and each other
  chunk's landmark is the mean of its post-RoPE keys;
- per KV head the `outlier_chunks` chunks whose keys are least similar to their landmark (the smallest minimum
  cosine between a key and its chunk's mean) stay resident and exact, with their values;
- the values of every other chunk move to host memory (pinned when the model runs on CUDA).

Each decode step, per layer (`get_retrieval_position_ids`, `get_key_cache`, `get_value_cache`): each query head's
softmax of `q . landmark * scaling` over the chunks, the max over its GQA group, picks the top `budget //
chunk_size` chunks per KV head; their keys are rebuilt as U[rows] (S V^T)_h and rotated to their positions, their
values fetched from host, and the group attends to those rows and everything resident (sinks, outliers, local
window, generated tokens), merged by log-sum-exp (`Selection.external`). Later chunks of the prompt (a question
after a compressed context, a new turn) go token by token through the same path (`steps_through_chunks`), as
the repo runs every chunk of up to 4K tokens after its prefill through the decode path.

Defaults are the repo's: chunk 8, rank 160 (`rank=160` in every model class of the release, models/llama.py,
qwen.py, glm.py, phi3.py: the same for every model, whatever its key width), capped by the key width H * D (and
by the segment's length), 48 outlier chunks (`ShadowKVCache`; the CPU-offload class uses 24 per 1024 of sparse
budget), 4 local chunks. `rank: scaled` is kvbench's earlier rule, 160/1024 of H * D (160 on Llama-3-8B's
8 x 128, half that on Yi-9B-200K's 4 x 128), an option for comparing equal compression of the keys. On narrow
keys the release's rank hardly compresses them: SmolLM2-135M's are 3 x 64 = 192 wide, so U alone is 160/192 of
the keys (the factors are counted in the records' storage), and a tiny test model's 32 are kept at full rank. The budget is the sparse budget in tokens per KV head (2048
in the paper, 1024 as CTKVR runs it); resident rows are attended on top of it, as in the repo.

`low_rank: false` (kvbench/conf/method/shadowkv_landmark.yaml, with no outliers) is the landmark part alone, as CTKVR
§4 describes ShadowKV: keys and values stay exact and resident, each step attends to the resident rows and the
top chunks by q . landmark. Nothing moves, nothing is freed.

Accounting: the factors and landmarks are auxiliary storage (`paper_elements`); host values count as host bytes
and as half a retained K/V row each (a value without its key); `step_traffic` reads the landmarks, the selected
rows of U, S V^T, the selected values and the resident K/V. Where kvbench departs from the repo: the prefill is
kvbench's dense one (the repo's MInference option is not used); landmark logits use the layer's softmax scale
1/sqrt(head_dim) (the repo's kv_cache.py hard-codes `/ math.sqrt(128)` in the landmark score: the same on every
model of the papers, whose heads are 128 wide, and a different temperature only for other head widths, e.g.
SmolLM2's 64, where the repo's softmax over chunks would be flatter by sqrt(2)); the repo's kernel cache of the chunks already
in the device buffer (a hit skips the fetch) is not modelled, so each step's traffic counts every selected
chunk; U keeps a row per segment token (as the repo) and the segment is the compressed one (the prompt, or the
context with `compress_question=false`); the SVD runs in fp32 on the model's device; the repo factors the keys
before applying RoPE, kvbench inverts the stored post-RoPE keys (`common/blocks.py`, exact up to fp32 rounding).
The top-k recall (`measure_recall`) of the low-rank mode is measured over the rebuilt keys, the exact ones being
gone. A model without RoPE is refused in the low-rank mode.

Against the release's landmarks, outliers and chunk selection on the same tensors: docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvbench.core.checks import is_int
from kvbench.core.contract import Selection
from kvbench.methods.base import OffloadMethod, register_method
from kvbench.methods.common.blocks import needs_rotary, rope, unrope
from kvbench.methods.common.derived import FixedState
from kvbench.methods.common.placement import recall_of

RELEASE_RANK = 160  # the release's rank for every model (models/*.py: rank=160)
RANK_SHARE = RELEASE_RANK / 1024  # `rank: scaled`: 160 per 1024 of key width (Llama-3-8B's 8 KV heads x 128)


@dataclass(frozen=True)
class ShadowState(FixedState):
    """The device side of one layer: landmarks `[H, C, D]` of each head's non-outlier chunks (`chunk_ids`
    `[H, C]`, ascending), its outlier chunks `[H, O]`, and with `low_rank` the key factors: `u` `[n, r]` (a row
    per segment position) and `sv` `[H, r, D]`. Chunk c covers positions `start + c * chunk_size` onwards;
    positions from `end` on are the local window and the generated tokens."""

    landmarks: torch.Tensor
    chunk_ids: torch.Tensor
    outliers: torch.Tensor
    start: int
    end: int
    chunk_size: int
    u: torch.Tensor | None = None
    sv: torch.Tensor | None = None

    def rows(self, chunks: torch.Tensor) -> torch.Tensor:
        """Positions `[H, k * chunk_size]` of chunks `[H, k]`."""
        offsets = torch.arange(self.chunk_size, device=chunks.device)
        return (self.start + chunks[..., None] * self.chunk_size + offsets).flatten(1)

    def keys(self, positions: torch.Tensor, rotary) -> torch.Tensor:
        """Keys `[H, m, D]` (fp32, post-RoPE) rebuilt from the factors at `positions` `[H, m]`."""
        pre = torch.einsum("hmr,hrd->hmd", self.u[positions].float(), self.sv.float())
        return rope(pre, positions, rotary)

    # -- the cache's derived-state protocol (`FixedState`: new tokens stay resident) -----------------------------
    def truncate(self, layer) -> "ShadowState":
        if layer.seen < self.end:
            raise ValueError("ShadowKV cannot roll back into its compressed segment")
        return self

    @property
    def paper_elements(self) -> int:  # landmarks and key factors: auxiliary storage
        return self.landmarks.numel() + sum(t.numel() for t in (self.u, self.sv) if t is not None)


@dataclass(frozen=True)
class HostValues(FixedState):
    """The values `[H, C, chunk_size, D]` of each head's non-outlier chunks (ShadowState's `chunk_ids` order),
    in host memory."""

    values: torch.Tensor
    end: int
    on_host = True

    truncate = ShadowState.truncate

    @property
    def kv_tokens(self) -> float:  # values without their keys: half a K/V row each
        return self.values[..., 0].numel() / 2


def low_rank_factors(pre_keys: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The repo's `get_svd`: pre-RoPE keys `[H, n, D]`, heads side by side `[n, H * D]`, truncated to `rank`:
    (U `[n, r]`, S V^T `[H, r, D]`, every singular value `[min(n, H * D)]`), fp32."""
    heads, n, dim = pre_keys.shape
    u, s, vh = torch.linalg.svd(pre_keys.float().transpose(0, 1).reshape(n, heads * dim), full_matrices=False)
    sv = (s[:rank, None] * vh[:rank]).view(-1, heads, dim).transpose(0, 1)
    return u[:, :rank], sv, s


def shadowkv_rank(rank: int | str, kv_heads: int, head_dim: int) -> int:
    """The rank of the keys' SVD on a model whose keys are `kv_heads` x `head_dim` wide: a number as given (the
    release's 160), `scaled` 160/1024 of the width; never more than the width (a factor cannot be wider)."""
    width = kv_heads * head_dim
    wanted = max(1, round(RANK_SHARE * width)) if rank == "scaled" else rank
    return min(wanted, width)


@register_method
@dataclass
class ShadowKV(OffloadMethod):
    name = "shadowkv"
    host_work = "ShadowKV gathers the selected values from host memory at every decode step"
    steps_through_chunks: ClassVar[bool] = True
    chunk_size: int = 8
    rank: int | str = RELEASE_RANK  # the release's 160 (capped by the key width); `scaled`: 160/1024 of H * D
    outlier_chunks: int = 48
    local_chunks: int = 4
    sink_tokens: int = 0
    low_rank: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_int(self.chunk_size) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        if self.rank != "scaled" and (not is_int(self.rank) or self.rank < 1):
            raise ValueError(f"rank must be a positive integer (the release's: 160) or scaled (160/1024 of the key "
                             f"width), got {self.rank!r}")
        for name in ("outlier_chunks", "local_chunks", "sink_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.low_rank, bool):
            raise ValueError(f"low_rank must be true or false, got {self.low_rank!r}")

    # the one "eviction" event (`OffloadMethod.schedule`) factors the keys and moves the values to host memory; they
    # are no `offloaded` rows (`layer.derived` has no "host"): a later chunk goes token by token instead
    def plan_derived(self, budget, prompt):
        return {"sparse_budget": budget, "select_chunks": budget // self.chunk_size, "chunk_size": self.chunk_size,
                "outlier_chunks": self.outlier_chunks, "local_chunks": self.local_chunks,
                "sink_tokens": self.sink_tokens, "low_rank": self.low_rank, "rank": self.rank}

    def layer_rank(self, layer) -> int:
        """The SVD rank of a layer: `shadowkv_rank` of its key width, capped by the segment's length."""
        return min(shadowkv_rank(self.rank, layer.num_heads, layer.head_dim), layer.seen)

    # -- the segment's end: landmarks, outliers, factors, values to host ----------------------------------------
    def keep(self, layer, budget, step):
        if layer.derived.get("shadowkv") is not None:
            return None  # compressed already
        n = layer.seen
        view = layer.head_view()
        if layer.is_ragged or view.keys.shape[1] != n:
            raise ValueError("ShadowKV compresses a layer that holds its whole segment, uniformly")
        cs = self.chunk_size
        start = min(self.sink_tokens, n)
        chunks = (n - start) // cs - self.local_chunks
        if chunks <= self.outlier_chunks:
            return None  # every chunk would be resident: nothing to select from
        heads, _, dim = view.keys.shape
        end = start + chunks * cs
        ctx = view.keys[:, start:end].float().view(heads, chunks, cs, dim)
        landmarks = ctx.mean(dim=2)  # [H, C, D]
        similarity = F.cosine_similarity(landmarks[:, :, None], ctx, dim=-1).amin(dim=-1)  # [H, C]
        outliers = similarity.topk(self.outlier_chunks, dim=-1, largest=False).indices.sort(dim=-1).values
        rest = torch.ones(heads, chunks, dtype=torch.bool, device=ctx.device)
        rest.scatter_(1, outliers, False)
        chunk_ids = torch.arange(chunks, device=ctx.device).expand(heads, -1)[rest].view(heads, -1)
        state = dict(landmarks=landmarks.gather(1, chunk_ids[..., None].expand(-1, -1, dim)).to(view.keys.dtype),
                     chunk_ids=chunk_ids, outliers=outliers, start=start, end=end, chunk_size=cs)
        if not self.low_rank:
            layer.derived["shadowkv"] = ShadowState(**state)
            return None
        rotary = needs_rotary(step.rotary, "ShadowKV's low-rank mode (low_rank: true)")
        u, sv, _ = low_rank_factors(unrope(view.keys, view.positions, rotary), self.layer_rank(layer))
        layer.derived["shadowkv"] = ShadowState(**state, u=u.to(view.keys.dtype), sv=sv.to(view.keys.dtype))
        values = view.values[:, start:end].view(heads, chunks, cs, dim)
        values = values.gather(1, chunk_ids[..., None, None].expand(-1, -1, cs, dim)).to("cpu")
        layer.derived["shadowkv_values"] = HostValues(values.pin_memory() if view.values.is_cuda else values, end)
        position = torch.arange(n, device=ctx.device)
        outlier_rows = ShadowState(**state).rows(outliers)  # [H, O * cs]
        resident = []
        for h in range(heads):
            mask = (position < start) | (position >= end)
            mask[outlier_rows[h]] = True
            resident.append(torch.nonzero(mask).flatten())
        return resident

    # -- decode -------------------------------------------------------------------------------------------------
    def select(self, layer, q, view, step, scaling):
        state = layer.derived.get("shadowkv")
        if state is None:
            return None
        heads, group, dim = q.shape
        logits = torch.einsum("hgd,hcd->hgc", q.float(), state.landmarks.float()) * scaling
        score = torch.softmax(logits, dim=-1).amax(dim=1)  # [H, C]: each head's softmax, the max over its group
        top = score.topk(min(step.plan.derived["select_chunks"], score.shape[1]), dim=-1).indices
        chunks = state.chunk_ids.gather(1, top)
        positions = state.rows(chunks)  # [H, k * cs]
        if not self.low_rank:  # storage rows are positions: nothing was moved
            length = view.keys.shape[1]
            every = torch.arange(length, device=q.device)
            resident = (every < state.start) | (every >= state.end)
            outlier_rows = state.rows(state.outliers)
            idx = torch.cat([every[resident].expand(heads, -1), outlier_rows, positions], dim=1)
            return Selection(idx[:, None, :].expand(heads, group, -1), extra={"selected_chunks": float(top.shape[1])})
        resident = torch.arange(view.keys.shape[1], device=q.device).expand(heads, group, -1)
        if top.shape[1] == 0:  # a sparse budget below one chunk: the resident rows alone
            return Selection(resident)
        host = layer.derived["shadowkv_values"]
        gather = top.to(host.values.device)[..., None, None].expand(-1, -1, *host.values.shape[2:])
        values = host.values.gather(1, gather).flatten(1, 2).to(q.device)
        keys = state.keys(positions, step.rotary).to(view.keys.dtype)
        moved = values.numel() * values.element_size() if host.values.device != q.device else 0
        recall = self._recall(q, view, state, step, scaling, top) if step.measure_recall else None
        return Selection(resident, external=(keys, values), recall=recall, moved_bytes=moved,
                         extra={"selected_chunks": float(top.shape[1]), "rank": float(state.u.shape[1])})

    @staticmethod
    def _recall(q, view, state, step, scaling, top) -> float:
        """Top-k attention recall over every token, the host rows' keys being the rebuilt (low-rank) ones."""
        host_keys = state.keys(state.rows(state.chunk_ids), step.rotary)  # [H, C * cs, D]
        everything = torch.cat([view.keys.float(), host_keys], dim=1)
        cs, length = state.chunk_size, view.keys.shape[1]
        host_rows = (top[..., None] * cs + torch.arange(cs, device=top.device)).flatten(1)
        rows = torch.cat([torch.arange(length, device=q.device).expand(q.shape[0], -1), length + host_rows], dim=1)
        return recall_of(q, everything, rows, None, scaling)

    def step_traffic(self, layer, selection, step):
        """The repo's work per step: every landmark; with low rank the selected rows of U, S V^T and the selected
        values, else the selected K/V; and the resident K/V."""
        if selection is None:
            return super().step_traffic(layer, None, step)
        state = layer.derived["shadowkv"]
        heads, dim = layer.num_heads, layer.head_dim
        landmarks = state.landmarks.numel()
        if not self.low_rank:
            return landmarks + 2 * dim * heads * selection.idx.shape[-1]
        selected = selection.external[0].shape[1] if selection.external is not None else 0
        rank = state.u.shape[1]
        return (landmarks + heads * selected * rank + state.sv.numel() + heads * selected * dim
                + 2 * dim * sum(layer.lengths()))
