"""InfLLM (Xiao et al. 2024, arXiv 2402.04617; code thunlp/InfLLM): a block memory in host memory with
representative keys, an LRU device cache of blocks, and attention over initial tokens, a local window and the
retrieved blocks (OmniKV's baseline, its App. C). Nothing is dropped.

Per layer (the repo's `ContextManager`): the first `n_init` tokens stay resident, and so do the last `n_local`
(the local window: tokens at distance < n_local from the current one). Between them, every full block of
`memory_block_size` tokens moves to host memory (pinned when the model runs on CUDA), after every prefill chunk
and whenever decoding pushes tokens out of the window (`append_global`: the repo forms a block once a block's
worth has left the window; the rest, the remainder, stays resident and attended). A block's representative key,
per query head, is the mean of the keys of its `repr_topk` tokens with the highest local score: the attention
probability each token received from the queries whose local window held it (the repo's
`global_remainder_local_score`: the joint-softmax probability of the local part, summed over queries).

Prefill (`prefill`): `chunked` (default), the repo's: the prompt, but its last token, goes through in chunks of
`prefill_chunk` (the repo's `exc_block_size`, 512), each one an eviction event (`Schedule.block_size`), and every
chunk's rows attend through the memory (`chunk_attention`, the repo's `_append`): each row to the stored rows in
its own local window at their positions, to the initial tokens and the remainder beyond its window, and to the
top-k blocks retrieved for the chunk by its mean query, one joint softmax; the cache never holds more than init +
remainder + window + one chunk. The last prompt token then runs alone as a decode step (GreedySearch's
`input_ids[:, -1:]`), which retrieves with its own query. `dense`: kvbench's one dense prefill of the whole
prompt, then the blocks (a token's local score is then its dense attention probability from the n_local queries
after it). Dense prefill gives InfLLM exact hidden states for the prompt and its first answer token from full
attention: it flatters InfLLM, and OmniKV's comparison ran the repo's chunked prefill.

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
attention; comparing the two separates what the position remapping costs from what retrieval misses.

What the records say: `topk_recall` is what retrieval found, the full attention's mass (every token at its own
position) on the retrieved blocks' rows over the mass of as many of the block memory's best rows; resident rows
(init, remainder, window) are no retrieval's doing and count neither way. Where the task knows where its answer
lies (`step.shared["evidence_positions"]`: a NIAH needle, a RULER answer), `decode_method_stats` has
`needle_in_memory` (the share of it held in the block memory, per layer and step) and `needle_retrieved` (the
share in the blocks retrieved).

Budget: the tokens attended per step, init + local + topk * block; the remainder, fewer than one block, is
attended on top, as in the repo. With `n_local` and `topk` both set the configuration is fixed, as the repo's
and OmniKV's runs are (conf/method/infllm_omnikv.yaml: their LongBench configuration, block 32, init 128, local
1024, top 16, cache 16), and the budget only switches compression on (at or above S: full attention). With
either null the budget is split by kvbench's rule, for equal-memory sweeps: the repo's Llama-3 / Mistral
configuration is init 128, local 4096, topk 16 x block 128 (6272 tokens), and a budget keeps its proportions:
init = min(n_init, budget / 8), topk = the blocks that fit in a third of the rest (the repo's 2048 of 6144),
local = what is left. `max_cached_blocks` null is 2 x topk (the repo's 32 for 16). A budget under init + 3
blocks retrieves nothing (topk 0): init + sliding window. The plan says which (`split`: fixed or budget).

Where kvbench departs from the repo: later chunks (a question after a compressed context, a new turn) go token
by token through the decode path (`steps_through_chunks`), where the repo scores blocks once per 512-token chunk
with the chunk's mean query; in a prefill chunk the repo's global part also attends, at the far edge, to the
remainder rows still inside the first rows' windows (`get_global_hidden_and_mask` offsets the complement mask by
the whole input's length, not the chunk's place in it), so they count twice for the chunk's first queries (up to
511 rows for the first query with local 1024 and chunks of 512, fewer down the chunk): kvbench attends each row
once, by its distance;
`score_decay`, `chunk_topk_calc` and the `lru-s` strategy (off in the repo's configurations) are not
implemented; the prefill chunks' block loads go through the LRU but are not counted in `decode_method_stats`; a
rollback cuts the blocks after it (a block it splits keeps its first rows, masked past the cut; its
representative is not recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.core.checks import is_int
from kvbench.core.contract import Plan, Schedule, Selection
from kvbench.methods.base import SelectionMethod, register_method
from kvbench.methods.common.block_memory import BlockCache, BlockMemory, BlockReprs
from kvbench.methods.common.blocks import needs_rotary, rope, unrope
from kvbench.methods.common.placement import mass_recall

SCORE_CHUNK = 2**25  # logits computed at once while scoring the prefill's tokens (bounds its memory)
SCORE = "infllm_score"  # token state: each token's local score per query head [H, L, G]


@register_method
@dataclass
class InfLLM(SelectionMethod):
    name = "infllm"
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
    prefill: str = "chunked"  # chunked: through the context memory, the repo's; dense: kvbench's dense prefill
    prefill_chunk: int = 512  # the repo's exc_block_size: prompt tokens attended (and then memorised) together

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_init", "n_local", "topk", "memory_block_size", "repr_topk", "max_cached_blocks",
                     "prefill_chunk"):
            value = getattr(self, name)
            least = 1 if name in ("memory_block_size", "repr_topk", "n_local", "prefill_chunk") else 0
            optional = name in ("n_local", "topk", "max_cached_blocks")
            if (value is not None or not optional) and (not is_int(value) or value < least):
                raise ValueError(f"{name} must be an integer >= {least}{' or null' if optional else ''}, got {value!r}")
        if self.memory_positions not in ("infllm", "exact"):
            raise ValueError(f"memory_positions must be infllm or exact, not {self.memory_positions!r}")
        if self.prefill not in ("chunked", "dense"):
            raise ValueError(f"prefill must be chunked or dense, not {self.prefill!r}")

    @property
    def last_prompt_token_via_decode(self) -> bool:
        # the repo's GreedySearch prefills all but the last prompt token, then runs that one as a decode step
        return self.prefill == "chunked"

    def schedule(self) -> Schedule:
        # the events move full blocks out of the resident set: after every prefill chunk (chunked) or at the
        # segment's end (dense), and after every decode step
        return Schedule(block_size=self.prefill_chunk if self.prefill == "chunked" else None, decode_every=1)

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
        block = self.memory_block_size
        fixed = self.n_local is not None and self.topk is not None  # a configuration of its own: the budget sets nothing
        init = self.n_init if fixed else min(self.n_init, budget // 8)
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
            "cached_blocks": cached, "attended": init + local + topk * block, "memory_positions": self.memory_positions,
            "split": "fixed" if fixed else "budget", "prefill": self.prefill,
            "prefill_chunk": self.prefill_chunk if self.prefill == "chunked" else None})

    # -- local scores --------------------------------------------------------------------------------------------
    @staticmethod
    def _accumulate(layer, score: torch.Tensor) -> None:
        """Add `[H, G, L]` local scores to the token state (a new tensor: clones share the old one)."""
        score = score.permute(0, 2, 1)
        old = layer.token_state[SCORE] if SCORE in layer.token_state else torch.zeros_like(score)
        layer.token_state[SCORE] = old + score

    def observe(self, layer, queries, step):
        """`prefill=dense`, a prefill chunk: each stored token's dense attention probability from the chunk's queries
        whose local window holds it. (A chunked prefill's scores are taken in `chunk_attention`, a decode step's in
        `select`, each from what it attended.)"""
        if self.prefill == "chunked" or step.plan is None or step.plan.select is None or queries.shape[1] == 1:
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

    # -- chunked prefill: each chunk through the context memory ----------------------------------------------------
    def chunk_attention(self, layer, query, step, scaling):
        """`prefill=chunked` (the repo's `ContextManager.append`, one `exc_block_size` chunk at a time): each query
        row attends to the stored rows within its local window (distance < n_local) at their own positions, and to
        everything else it may see, the initial tokens, the remainder beyond its window and the top-k blocks the
        chunk retrieves from the memory (by its mean query), at the window's far edge (`memory_positions=infllm`)
        or at their own (`exact`); one joint softmax. The local part's probabilities are the tokens' local scores.
        None (the dispatcher's dense causal attention, the same up to rounding) while nothing is beyond any row's
        window and the memory is empty."""
        if self.prefill != "chunked":
            return None
        d = step.plan.derived
        local, topk = d["n_local"], d["topk"]
        view = layer.head_view()
        heads, length, dim = view.keys.shape
        n, group = query.shape[1], query.shape[0] // heads
        q = query.view(heads, group, n, dim).float()
        q_pos = layer.seen - n + torch.arange(n, device=q.device)
        dist = q_pos[:, None] - view.positions[0].long()[None, :]  # [n, L]
        near, far = (dist >= 0) & (dist < local), dist >= local
        logits = torch.einsum("hgnd,hld->hgnl", q, view.keys.float()) * scaling
        memory, reprs = layer.derived.get("infllm_memory"), layer.derived.get("infllm_reprs")
        infllm = self.memory_positions == "infllm"
        if infllm and (bool(far.any()) or memory is not None):
            rotary = needs_rotary(step.rotary, "InfLLM's memory_positions=infllm")
            q_far = rope(unrope(q, q_pos, rotary), torch.full_like(q_pos, local - 1), rotary)
            far_logits = torch.einsum("hgnd,hld->hgnl", q_far, unrope(view.keys, view.positions, rotary)) * scaling
            logits = torch.where(far, far_logits, logits)  # every row's own split of the stored rows
        else:
            q_far = q
        logits = logits.masked_fill(~(near | far), float("-inf"))
        external = None
        if memory is not None and topk > 0:
            chosen, _ = self._top_blocks(q_far.mean(dim=2), reprs.reprs, topk)
            cache = layer.derived["infllm_cache"]
            cache.prune(memory.blocks)
            cache.load(chosen, memory, q.device)
            keys, values, valid = cache.gather(chosen, memory, q.device)
            outer = torch.einsum("hgnd,hmd->hgnm", q_far, keys.float()) * scaling  # stored as attended: no rotation
            if valid is not None:
                outer = outer.masked_fill(~valid[:, None, None, :], float("-inf"))
            external = (outer, values)
        elif not bool(far.any()):
            probs = torch.softmax(logits, dim=-1)
            self._accumulate(layer, (probs * near).sum(dim=2))
            return None
        joint = logits if external is None else torch.cat([logits, external[0]], dim=-1)
        probs = torch.softmax(joint, dim=-1)
        mine = probs[..., :length]
        self._accumulate(layer, (mine * near).sum(dim=2))
        out = torch.einsum("hgnl,hld->hgnd", mine, view.values.float())
        if external is not None:
            out = out + torch.einsum("hgnm,hmd->hgnd", probs[..., length:], external[1].float())
        return out.reshape(heads * group, n, dim).to(query.dtype)

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
            query = q.float()
            if infllm:  # the repo's query at angle n_local - 1 against unrotated representative keys
                at = torch.full((group,), p, device=q.device)
                query = rope(unrope(query, at, rotary), torch.full_like(at, local - 1), rotary)
            chosen, scored = self._top_blocks(query, reprs.reprs, topk)
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
        extra = {"retrieved_blocks": float(len(chosen)), "scored_blocks": float(scored), "cache_hits": float(hits),
                 "cache_misses": float(misses)}
        if "evidence_positions" in step.shared:
            extra.update(self._needle(memory, chosen, step.shared["evidence_positions"]))
        recall = self._recall(q, view, memory, chosen, step, scaling) if step.measure_recall and chosen else None
        return Selection(rows.expand(heads, group, -1), external=external, recall=recall, moved_bytes=moved,
                         extra=extra)

    @staticmethod
    def _top_blocks(query, reprs, topk) -> tuple[list[int], int]:
        """`calc_block_topk`: every block while there are at most topk, else the topk by `query` `[H, G, D]` (in the
        representatives' frame: at n_local - 1 against unrotated ones with `memory_positions=infllm`) against the
        representative keys, summed over every query head. (chosen, blocks scored)."""
        blocks = reprs.shape[0]
        if blocks <= topk:
            return list(range(blocks)), 0
        score = torch.einsum("hgd,bhgd->b", query.float(), reprs.float())
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

    @staticmethod
    def _needle(memory: BlockMemory | None, chosen: list[int], span) -> dict[str, float]:
        """Where the task knows the evidence (`step.shared["evidence_positions"]`, [start, end): the needle, the
        answer), the share of its positions held in the block memory and the share in the blocks retrieved."""
        at = torch.arange(int(span[0]), int(span[1]))
        count = max(1, at.numel())
        if memory is None:
            return {"needle_in_memory": 0.0, "needle_retrieved": 0.0}
        inside = (at[:, None] >= memory.starts[None, :]) & (at[:, None] < (memory.starts + memory.lengths)[None, :])
        picked = torch.zeros(memory.blocks, dtype=torch.bool)
        picked[torch.tensor(chosen, dtype=torch.long)] = True
        return {"needle_in_memory": float(inside.any(1).sum()) / count,
                "needle_retrieved": float((inside & picked[None, :]).any(1).sum()) / count}

    def _recall(self, q, view, memory, chosen, step, scaling) -> float:
        """What retrieval found: with every token at its own position and the full attention over all of them, the
        attention mass on the retrieved blocks' rows over the mass of the top as many rows of the block memory
        (resident rows are no retrieval's doing, so they count neither way)."""
        bs = memory.keys.shape[2]
        mem_keys = memory.keys.to(q.device).transpose(0, 1).flatten(1, 2)  # [H, B * bs, D]
        at = (memory.starts.to(q.device)[:, None] + torch.arange(bs, device=q.device)).flatten()
        if self.memory_positions == "infllm":
            mem_keys = rope(mem_keys, at.expand(mem_keys.shape[0], -1), step.rotary)
        logits = torch.einsum("hgd,hnd->hgn", q.float(), torch.cat([view.keys.float(), mem_keys.float()], 1)) * scaling
        if view.valid is not None:
            logits[..., :view.keys.shape[1]] = logits[..., :view.keys.shape[1]].masked_fill(
                ~view.valid[:, None, :], float("-inf"))
        alive = (torch.arange(bs, device=q.device)[None, :] < memory.lengths.to(q.device)[:, None]).flatten()
        probs = torch.softmax(logits, dim=-1)[..., view.keys.shape[1]:] * alive  # [H, G, B * bs]
        picked = (torch.tensor(chosen, device=q.device)[:, None] * bs + torch.arange(bs, device=q.device)).flatten()
        rows = int(alive[picked].sum())
        return mass_recall(probs, probs[..., picked].sum(-1), max(1, rows))

    def step_traffic(self, layer, selection, step):
        """Per step: the representative keys scored (every query head's), the attended storage rows and the
        retrieved blocks' K/V."""
        if selection is None:
            return super().step_traffic(layer, None, step)
        heads, dim = selection.idx.shape[0], layer.head_dim
        reprs = selection.extra["scored_blocks"] * heads * selection.idx.shape[1] * dim
        return int(reprs + 2 * dim * heads * (selection.idx.shape[-1] + selection.external[0].shape[1]))
