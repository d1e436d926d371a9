"""InfLLM (Xiao et al. 2024, arXiv 2402.04617; code thunlp/InfLLM): a block memory in host memory with
representative keys, an LRU device cache of blocks, and attention over initial tokens, a local window and the
retrieved blocks (OmniKV's baseline, specs/omnikv.md §5). Nothing is dropped.

Per layer (the repo's `ContextManager`): the first `n_init` tokens stay resident, and so do the last `n_local`
(the local window: tokens at distance < n_local from the current one). Between them, every full block of
`memory_block_size` tokens moves to host memory (pinned when the model runs on CUDA), at the end of the
compressed segment and whenever decoding pushes tokens out of the window (`append_global`: the repo forms a
block once a block's worth has left the window; the rest, the remainder, stays resident and attended). A
block's representative key, per query head, is the mean of the keys of its `repr_topk` tokens with the highest
local score: the attention probability each token received from the queries whose local window held it (the
repo's `global_remainder_local_score`: the joint-softmax probability of the local part, summed over queries).

Each decode step: the blocks are scored by the query against their representative keys, summed over every
query head of the layer (one set for the layer, as the repo's `calc_block_topk`: all blocks while there are at
most `topk`), the top `topk` go through an LRU device cache of `max_cached_blocks` blocks (a hit costs nothing,
a miss loads the block; least recently used blocks not needed now are evicted, `remove_lru_blocks`; hits,
misses and retrieved blocks are in the record's `decode_method_stats`, the bytes a miss moves across devices in
`decode_moved_bytes_per_step`), and the query attends to init + remainder + window + retrieved blocks, the
blocks merged by log-sum-exp (`Selection.external`).

Positions (`memory_positions`): `infllm`, the repo's, puts every token outside the local window (init, remainder,
blocks) at the window's far edge, distance n_local - 1 from the query (the query is rotated to n_local - 1 and
those keys are kept without RoPE, `apply_rotary_pos_emb_one_angle`); the window keeps its relative positions.
kvbench stores blocks' keys pre-RoPE in this mode and rotates them with the model's RoPE (`Step.rotary`; a model
without RoPE is refused). `exact` keeps every key at its own position, so retrieving every block is full
attention.

Budget: the tokens attended per step, init + local + topk * block (OmniKV compares InfLLM at a memory share
only approximately); the remainder, fewer than one block, is attended on top, as in the repo. The repo's
Llama-3 / Mistral configuration is init 128, local 4096, topk 16 x block 128 (6272 tokens); a budget keeps its
proportions: init = min(n_init, budget / 8), topk = the blocks that fit in a third of the rest (the repo's 2048
of 6144), local = what is left; `topk` and `n_local` fix them. `max_cached_blocks` null is 2 x topk (the repo's
32 for 16). A budget under init + 3 blocks retrieves nothing (topk 0): init + sliding window.

Where kvbench departs from the repo: the prefill is kvbench's dense one (the repo runs InfLLM's own sparse
attention over chunks of `exc_block_size` = 512), so a prompt token's local score is its dense attention
probability from the n_local queries after it; later chunks of the prompt (a question after a compressed
context, a new turn) go token by token through the decode path (`steps_through_chunks`), where the repo scores
blocks once per 512-token chunk with the chunk's mean query; `score_decay`, `chunk_topk_calc` and the `lru-s`
strategy (off in the repo's configurations) are not implemented; a rollback cuts the blocks after it (a block it
splits keeps its first rows, masked past the cut; its representative is not recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvbench.core.checks import is_int
from kvbench.core.contract import Plan, Schedule, Selection
from kvbench.methods.base import Method, register_method
from kvbench.methods.common.blocks import needs_rotary, rope, unrope
from kvbench.methods.common.placement import recall_of

SCORE_CHUNK = 2**25  # logits computed at once while scoring the prefill's tokens (bounds its memory)
SCORE = "infllm_score"  # token state: each token's local score per query head [H, L, G]


@dataclass(frozen=True)
class BlockMemory:
    """One layer's block memory in host memory: keys and values `[B, H, bs, D]` (keys pre-RoPE with
    `memory_positions=infllm`, post-RoPE with `exact`), each block's first position `starts` `[B]` and valid rows
    `lengths` `[B]` (bs unless a rollback cut the block)."""

    keys: torch.Tensor
    values: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    on_host = True
    paper_elements = 0

    def added(self, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor) -> "BlockMemory":
        """New blocks after these (a new object: a copy of the cache may share this one)."""
        lengths = torch.full_like(starts, keys.shape[2])
        return BlockMemory(*(torch.cat([old, new]) for old, new in zip(
            (self.keys, self.values, self.starts, self.lengths), (keys, values, starts, lengths))))

    @property
    def blocks(self) -> int:
        return self.keys.shape[0]

    def kept(self, layer) -> "BlockMemory":
        return self

    def append(self, layer, n: int) -> "BlockMemory":
        return self

    def truncate(self, layer) -> "BlockMemory | None":
        alive = self.starts < layer.seen
        if bool(alive.all()) and int((self.starts + self.lengths).max()) <= layer.seen:
            return self
        if not bool(alive.any()):
            return None
        lengths = (layer.seen - self.starts[alive]).clamp(max=self.keys.shape[2])
        return BlockMemory(self.keys[alive], self.values[alive], self.starts[alive], torch.minimum(
            self.lengths[alive], lengths))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.starts, self.lengths))

    @property
    def kv_tokens(self) -> int:
        return self.keys.shape[1] * int(self.lengths.sum())


@dataclass(frozen=True)
class BlockReprs:
    """Each block's representative key per query head, `[B, H, G, D]` on the device, and its first position."""

    reprs: torch.Tensor
    starts: torch.Tensor
    on_host = False

    def kept(self, layer) -> "BlockReprs":
        return self

    def append(self, layer, n: int) -> "BlockReprs":
        return self

    def truncate(self, layer) -> "BlockReprs | None":
        alive = self.starts < layer.seen
        if bool(alive.all()):
            return self
        return BlockReprs(self.reprs[alive], self.starts[alive]) if bool(alive.any()) else None

    def nbytes(self) -> int:
        return self.reprs.numel() * self.reprs.element_size() + self.starts.numel() * self.starts.element_size()

    @property
    def paper_elements(self) -> int:  # representative keys: auxiliary storage
        return self.reprs.numel()


@dataclass
class BlockCache:
    """InfLLM's LRU device cache of at most `capacity` blocks (`CudaCache` + `cached_blocks`): each cached
    block's last use, and its device copy when the memory lives in another device's memory. Updated in place at
    every step, so a copy of the cache forks it."""

    capacity: int
    last_use: dict[int, int] = field(default_factory=dict)
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    clock: int = 0
    on_host = False
    paper_elements = 0

    def load(self, chosen: list[int], memory: BlockMemory | None = None,
             device: torch.device | None = None) -> tuple[int, int]:
        """Make `chosen` resident (`remove_lru_blocks`, then the repo's `lru` stamp): (hits, misses)."""
        misses = [b for b in chosen if b not in self.last_use]
        excess = len(self.last_use) + len(misses) - self.capacity
        for b, _ in sorted(self.last_use.items(), key=lambda item: item[1]):  # oldest first, ties in load order
            if excess <= 0:
                break
            if b not in chosen:
                del self.last_use[b]
                self.copies.pop(b, None)
                excess -= 1
        self.clock += 1
        for b in chosen:
            self.last_use[b] = self.clock
        if memory is not None and memory.keys.device != device:
            for b in misses:
                self.copies[b] = (memory.keys[b].to(device), memory.values[b].to(device))
        return len(chosen) - len(misses), len(misses)

    def gather(self, chosen: list[int], memory: BlockMemory, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Keys and values `[H, k * bs, D]` of the chosen blocks on `device`, and their valid rows (None: all)."""
        pairs = [self.copies.get(b, (memory.keys[b], memory.values[b])) for b in chosen]
        keys, values = (torch.stack([p[i] for p in pairs]).to(device).transpose(0, 1).flatten(1, 2) for i in (0, 1))
        lengths = memory.lengths[chosen]
        if bool((lengths == memory.keys.shape[2]).all()):
            return keys, values, None
        valid = torch.arange(memory.keys.shape[2]) < lengths[:, None]
        return keys, values, valid.flatten().to(device).expand(keys.shape[0], -1)

    def prune(self, blocks: int) -> None:
        """Forget blocks a rollback removed."""
        for b in [b for b in self.last_use if b >= blocks]:
            del self.last_use[b]
            self.copies.pop(b, None)

    def kept(self, layer) -> "BlockCache":
        return self

    def append(self, layer, n: int) -> "BlockCache":
        return self

    def truncate(self, layer) -> "BlockCache":
        return self  # blocks a rollback removed are forgotten at the next step (`prune`)

    def fork(self) -> "BlockCache":
        return BlockCache(self.capacity, dict(self.last_use), dict(self.copies), self.clock)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.copies.values() for t in pair)


@register_method
@dataclass
class InfLLM(Method):
    name = "infllm"
    family = "selection"
    selects = True
    host_work = "InfLLM's block cache is managed on the host (LRU) at every decode step"
    observes = True
    steps_through_chunks: ClassVar[bool] = True
    n_init: int = 128
    n_local: int | None = None  # null: what the budget leaves after init and topk blocks
    topk: int | None = None  # null: the blocks that fit in a third of the budget after init
    memory_block_size: int = 128
    repr_topk: int = 4
    max_cached_blocks: int | None = None  # null: 2 x topk (the repo's 32 for 16)
    memory_positions: str = "infllm"  # infllm: beyond the window at its far edge (the repo); exact: their own

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_init", "n_local", "topk", "memory_block_size", "repr_topk", "max_cached_blocks"):
            value = getattr(self, name)
            least = 1 if name in ("memory_block_size", "repr_topk", "n_local") else 0
            optional = name in ("n_local", "topk", "max_cached_blocks")
            if (value is not None or not optional) and (not is_int(value) or value < least):
                raise ValueError(f"{name} must be an integer >= {least}{' or null' if optional else ''}, got {value!r}")
        if self.memory_positions not in ("infllm", "exact"):
            raise ValueError(f"memory_positions must be infllm or exact, not {self.memory_positions!r}")

    def schedule(self) -> Schedule:
        # the events move full blocks out of the resident set: at the segment's end and after every decode step
        return Schedule(block_size=None, decode_every=1)

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
        block = self.memory_block_size
        init = min(self.n_init, budget // 8)
        topk = self.topk if self.topk is not None else (budget - init) // (3 * block)
        local = self.n_local if self.n_local is not None else budget - init - topk * block
        if local < 1:
            raise ValueError(f"infllm: budget {budget} leaves no local window after {init} initial tokens and "
                             f"{topk} blocks of {block}")
        cached = self.max_cached_blocks if self.max_cached_blocks is not None else 2 * topk
        if cached < topk:
            raise ValueError(f"infllm: max_cached_blocks ({cached}) must hold the topk ({topk}) blocks of a step")
        return Plan(evict=budget, select=budget, derived={
            "n_init": init, "n_local": local, "topk": topk, "block_size": block, "repr_topk": self.repr_topk,
            "cached_blocks": cached, "attended": init + local + topk * block, "memory_positions": self.memory_positions})

    # -- local scores --------------------------------------------------------------------------------------------
    @staticmethod
    def _accumulate(layer, score: torch.Tensor) -> None:
        """Add `[H, G, L]` local scores to the token state (a new tensor: clones share the old one)."""
        score = score.permute(0, 2, 1)
        old = layer.token_state[SCORE] if SCORE in layer.token_state else torch.zeros_like(score)
        layer.token_state[SCORE] = old + score

    def observe(self, layer, queries, step):
        """A prefill chunk: each stored token's dense attention probability from the chunk's queries whose
        local window holds it. (A decode step's scores are taken in `select`, from what it attended.)"""
        if step.plan is None or step.plan.select is None or queries.shape[1] == 1:
            return
        local = step.plan.derived["n_local"]
        view = layer.head_view()
        heads, length, dim = view.keys.shape
        n, group = queries.shape[1], queries.shape[0] // heads
        key_pos = view.positions[0].long()
        q_all = queries.view(heads, group, n, dim)
        score = torch.zeros(heads, group, length, device=queries.device)
        chunk = max(1, SCORE_CHUNK // (heads * group * length))
        for s in range(0, n, chunk):
            q = q_all[:, :, s:s + chunk].float()
            dist = (layer.seen - n + s + torch.arange(q.shape[2], device=q.device))[:, None] - key_pos[None, :]
            logits = torch.einsum("hgcd,hld->hgcl", q, view.keys.float()) * layer.scaling
            probs = torch.softmax(logits.masked_fill_(dist < 0, float("-inf")), dim=-1)
            score += probs.masked_fill_(dist >= local, 0.0).sum(dim=2)
        self._accumulate(layer, score)

    # -- the events: full blocks beyond the window move to the block memory ----------------------------------------
    def keep(self, layer, budget, step):
        d = step.plan.derived
        init, local, block = d["n_init"], d["n_local"], d["block_size"]
        view = layer.head_view()
        pos = view.positions[0]
        remainder = torch.nonzero((pos >= init) & (pos < layer.seen - local)).flatten()
        blocks = remainder.numel() // block
        if blocks == 0:
            return None
        if SCORE not in layer.token_state:
            raise ValueError("InfLLM's representative tokens need the local scores of the prefill (observe)")
        heads, _, dim = view.keys.shape
        rows = remainder[:blocks * block]
        keys = view.keys[:, rows]
        if self.memory_positions == "infllm":
            keys = unrope(keys, view.positions[:, rows], needs_rotary(step.rotary, "InfLLM's memory_positions=infllm"))
        keys = keys.view(heads, blocks, block, dim)
        score = layer.token_state[SCORE][:, rows].view(heads, blocks, block, -1)  # [H, B, bs, G]
        group = score.shape[-1]
        top = score.topk(min(d["repr_topk"], block), dim=2).indices.permute(0, 1, 3, 2)  # [H, B, G, r]
        chosen = keys.float()[:, :, None].expand(-1, -1, group, -1, -1).gather(
            3, top[..., None].expand(-1, -1, -1, -1, dim))
        reprs = chosen.mean(dim=3).transpose(0, 1).to(view.keys.dtype)  # [B, H, G, D]
        starts = pos[rows[::block]].long()
        host = [t.transpose(0, 1).to(view.keys.dtype).to("cpu") for t in (keys, view.values[:, rows].view(keys.shape))]
        if view.keys.is_cuda:
            host = [t.pin_memory() for t in host]
        memory, old_reprs = layer.derived.get("infllm_memory"), layer.derived.get("infllm_reprs")
        if memory is None:
            empty = starts[:0].cpu()
            memory = BlockMemory(host[0][:0], host[1][:0], empty, empty)
        layer.derived["infllm_memory"] = memory.added(*host, starts.cpu())
        layer.derived["infllm_reprs"] = BlockReprs(
            reprs if old_reprs is None else torch.cat([old_reprs.reprs, reprs]),
            starts if old_reprs is None else torch.cat([old_reprs.starts, starts]))
        layer.derived.setdefault("infllm_cache", BlockCache(d["cached_blocks"]))
        moving = torch.zeros(pos.shape[0], dtype=torch.bool, device=pos.device)
        moving[rows] = True
        return [torch.nonzero(~moving).flatten()] * layer.num_heads

    # -- decode ---------------------------------------------------------------------------------------------------
    def select(self, layer, q, view, step, scaling):
        d = step.plan.derived
        local, topk = d["n_local"], d["topk"]
        heads, group, dim = q.shape
        p = layer.seen - 1
        pos = view.positions[0]
        window = pos > p - local
        infllm = self.memory_positions == "infllm"
        rotary = needs_rotary(step.rotary, "InfLLM's memory_positions=infllm") if infllm else None
        target = p - local + 1  # where the repo puts every token beyond the window
        memory, reprs = layer.derived.get("infllm_memory"), layer.derived.get("infllm_reprs")
        keys, values, valid = [], [], []
        rows = torch.arange(pos.shape[0], device=q.device)
        if infllm and not bool(window.all()):
            outer = rows[~window]
            keys.append(rope(unrope(view.keys[:, outer], view.positions[:, outer], rotary),
                             torch.full((heads, outer.numel()), target, device=q.device), rotary))
            values.append(view.values[:, outer])
            valid.append(torch.ones(heads, outer.numel(), dtype=torch.bool, device=q.device))
            rows = rows[window]
        chosen, scored, hits, misses, moved = [], 0, 0, 0, 0
        if memory is not None and topk > 0:
            chosen, scored = self._top_blocks(q, reprs.reprs, p, local, topk, rotary)
            cache = layer.derived["infllm_cache"]
            cache.prune(memory.blocks)
            hits, misses = cache.load(chosen, memory, q.device)
            k, v, ok = cache.gather(chosen, memory, q.device)
            if infllm:
                k = rope(k, torch.full(k.shape[:2], target, device=q.device), rotary)
            keys.append(k.to(view.keys.dtype))
            values.append(v)
            valid.append(ok if ok is not None else torch.ones(k.shape[:2], dtype=torch.bool, device=q.device))
            if memory.keys.device != q.device:
                moved = misses * 2 * memory.keys[0].numel() * memory.keys.element_size()
        external = (torch.cat(keys, 1), torch.cat(values, 1), torch.cat(valid, 1)) if keys else None
        self._score_step(layer, q, view, rows, window, external, scaling)
        if external is None:
            return None  # init + remainder + window, all in storage at their own positions: dense
        recall = self._recall(q, view, memory, chosen, step, scaling) if step.measure_recall and chosen else None
        return Selection(rows.expand(heads, group, -1), external=external, recall=recall, moved_bytes=moved,
                         extra={"retrieved_blocks": float(len(chosen)), "scored_blocks": float(scored),
                                "cache_hits": float(hits), "cache_misses": float(misses)})

    def _top_blocks(self, q, reprs, p, local, topk, rotary) -> tuple[list[int], int]:
        """`calc_block_topk`: every block while there are at most topk, else the topk by the query against the
        representative keys summed over every query head. (chosen, blocks scored)."""
        blocks = reprs.shape[0]
        if blocks <= topk:
            return list(range(blocks)), 0
        query = q.float()
        if rotary is not None:  # the repo's query at angle n_local - 1 against unrotated representative keys
            at = torch.full((q.shape[1],), p, device=q.device)
            query = rope(unrope(query, at, rotary), torch.full_like(at, local - 1), rotary)
        score = torch.einsum("hgd,bhgd->b", query, reprs.float())
        return score.topk(topk).indices.tolist(), blocks

    def _score_step(self, layer, q, view, rows, window, external, scaling) -> None:
        """The repo's local score of this step: each window token's probability in the step's joint softmax."""
        logits = torch.einsum("hgd,hld->hgl", q.float(), view.keys.float()) * scaling
        attended = torch.zeros(window.shape[0], dtype=torch.bool, device=q.device)
        attended[rows] = True
        logits = logits.masked_fill(~attended, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        if external is not None:
            outer = torch.einsum("hgd,hmd->hgm", q.float(), external[0].float()) * scaling
            lse = torch.logaddexp(lse, torch.logsumexp(outer.masked_fill(~external[2][:, None], float("-inf")), -1))
        self._accumulate(layer, torch.exp(logits - lse[..., None]) * window)

    def _recall(self, q, view, memory, chosen, step, scaling) -> float:
        """Top-k attention recall over every token at its own position (storage and block memory)."""
        bs = memory.keys.shape[2]
        mem_keys = memory.keys.to(q.device).transpose(0, 1).flatten(1, 2)  # [H, B * bs, D]
        if self.memory_positions == "infllm":
            at = (memory.starts.to(q.device)[:, None] + torch.arange(bs, device=q.device)).flatten()
            mem_keys = rope(mem_keys, at.expand(mem_keys.shape[0], -1), step.rotary)
        everything = torch.cat([view.keys.float(), mem_keys.float()], dim=1)
        length = view.keys.shape[1]
        picked = (torch.tensor(chosen, device=q.device)[:, None] * bs + torch.arange(bs, device=q.device)).flatten()
        rows = torch.cat([torch.arange(length, device=q.device), length + picked]).expand(q.shape[0], -1)
        return recall_of(q, everything, rows, None, scaling)

    def step_traffic(self, layer, selection, step):
        """Per step: the representative keys scored (every query head's), the attended storage rows and the
        retrieved blocks' K/V."""
        if selection is None:
            return super().step_traffic(layer, None, step)
        heads, dim = selection.idx.shape[0], layer.head_dim
        reprs = selection.extra["scored_blocks"] * heads * selection.idx.shape[1] * dim
        return int(reprs + 2 * dim * heads * (selection.idx.shape[-1] + selection.external[0].shape[1]))
