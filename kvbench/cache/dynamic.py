"""`DynamicKVLayer`: the eager layout of a layer's row storage (`kvbench.cache.layer`'s docstring): Python lengths,
appends into slack (amortised O(1)), eviction and rollback by `retain`, clones that share buffers copy on write.
Every layer of a cache is one, except during a decode loop on the static layout (`kvbench.cache.static`)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from kvbench.cache.layer import KVLayer, growth_slack
from kvbench.cache.token_state import FIXED_FIELDS
from kvbench.core.contract import HeadView, Selection, Step, StepMethod
from kvbench.kernels.decode_attention import decode_attention
from kvbench.kernels.sparse_attention import topk_attention


class DynamicKVLayer(KVLayer):
    """The eager layout (module docstring): Python lengths, appends into slack, eviction by `retain`. Every layer
    of a cache is one, except during a decode loop on the static layout (`StaticKVLayer`)."""

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """`update`'s storing of a chunk's keys and values (`[1, H, q, D]`, one copy per head)."""
        q = key_states.shape[2]
        before = self.kv_nbytes()
        new_pos = torch.arange(self.seen, self.seen + q, dtype=torch.int32, device=key_states.device)
        incoming = {"keys": key_states[0], "values": value_states[0], "positions": new_pos.expand(self.num_heads, q)}
        if not self.buffers:
            self._install({name: t.reshape(-1, *t.shape[2:]) for name, t in incoming.items()}, [q] * self.num_heads)
        else:
            self._append(incoming, q)
        self.seen += q
        self.derived = {name: state.append(self, q) for name, state in self.derived.items()}
        self.peak_len = max(self.peak_len, self.physical_length())
        self.cache._account(self.kv_nbytes() - before)
        self.fresh = True  # the attention function checks that the forward it serves updated this layer
        return self.keys, self.values

    def field(self, name: str) -> torch.Tensor:
        """A per-token field: a `[H, L, ...]` view on a uniform layer (`[1, H, L, D]` for keys and values,
        as the model sees them), the flat buffer `[R, ...]` (slack included; see `starts`) of keys, values
        and positions on a ragged one, and a compact copy of method state there."""
        buf = self.buffers[name]
        if not self.is_ragged:
            heads = len(self.lens)
            view = buf.view(heads, buf.shape[0] // heads, *buf.shape[1:])[:, : self.lens[0]]
            return view[None] if name in ("keys", "values") else view
        return buf if name in FIXED_FIELDS else buf.index_select(0, self.used_rows())

    def lengths(self) -> list[int]:
        return list(self.lens)

    def held_tokens(self) -> int:
        """Tokens held over all heads."""
        return sum(self.lens)

    def physical_length(self) -> int:
        """The longest head's tokens: the width of a padded view."""
        return max(self.lens, default=0)

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens per head, so that appending them copies nothing (derived state
        that grows with the tokens reserves its own room too)."""
        if self.buffers and not self._room_for(tokens):
            self._install(self._compact(), self.lens, slack=tokens)
            self.relayouts += 1
        for state in self.derived.values():
            if hasattr(state, "reserve"):
                state.reserve(tokens)

    def _room_for(self, q: int) -> bool:
        return all(c == n and n + q <= cap for c, n, cap in zip(self.claimed, self.lens, self.caps))

    def _append(self, incoming: dict[str, torch.Tensor], q: int) -> None:
        """Write `q` new tokens per head (`incoming[name]`: `[H, q, ...]`) after each head's rows: in place
        when the buffers have room this layer may claim, else into new buffers with slack."""
        if not self._room_for(q):
            longest = max(self.lens) + q
            self._install(self._compact(), self.lens, slack=max(q, growth_slack(longest)))
            self.relayouts += 1
        heads = len(self.lens)
        if not self.is_ragged:  # a strided slice: same rows as the index list below, one copy kernel
            length = self.lens[0]
            for name, buf in self.buffers.items():
                view = buf.view(heads, buf.shape[0] // heads, *buf.shape[1:])[:, length:length + q]
                view.copy_(incoming[name]) if name in incoming else view.zero_()
        else:
            dest = torch.tensor([s + n + i for s, n in zip(self.starts, self.lens) for i in range(q)],
                                device=self.buffers["keys"].device)
            for name, buf in self.buffers.items():
                if name in incoming:
                    buf.index_copy_(0, dest, incoming[name].reshape(-1, *buf.shape[1:]))
                else:
                    buf.index_fill_(0, dest, 0)
        self.lens = [n + q for n in self.lens]
        self.claimed[:] = self.lens  # in place: every layer sharing these buffers sees the claim

    def head_view(self) -> HeadView:
        """Keys/values as `[H, L_max, D]`: a free view when uniform, a padded copy when ragged. On a static layer
        `[H, width, D]` over the capacity, with `valid` and the device `lengths`."""
        if not self.is_ragged:
            return HeadView(self.keys[0], self.values[0], self.positions, None)
        rows, valid = self._padded_rows()
        positions = self.buffers["positions"][rows]
        positions = torch.where(valid, positions, torch.full_like(positions, -1))
        return HeadView(self.buffers["keys"][rows], self.buffers["values"][rows], positions, valid)

    def _padded_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        lens = torch.tensor(self.lens, device=self.buffers["keys"].device)
        slot = torch.arange(int(lens.max()), device=lens.device)[None, :]
        valid = slot < lens[:, None]
        rows = (self._offsets()[:, None] + slot).clamp(max=self.buffers["keys"].shape[0] - 1)
        return rows, valid

    def retain(self, indices: list[torch.Tensor]) -> None:
        """Keep, per head, the tokens at `indices[h]` (sorted positions in the head's current storage).

        `G * H` index lists split every head into G copies, copy `i` reading head `i // G` (per-query-head
        eviction). Keys, values, positions and every token-state tensor move with the same rows. An eviction
        that drops few rows per head from buffers this layer holds alone (`_rewritable`: a decode step's) moves
        the kept rows down in place, and the rows it frees are slack for the next appends; any other (a
        compression) gathers the kept rows into new compact tensors, so the old storage is freed.
        """
        if len(indices) % self.num_heads:
            raise ValueError(f"{len(indices)} index lists for {self.num_heads} heads")
        copies = len(indices) // self.num_heads
        new_lens = [int(ix.numel()) for ix in indices]
        before = self.kv_nbytes()
        if copies == 1 and self._rewritable(new_lens):
            self._retain_in_place(indices, new_lens)
        else:
            device = self.buffers["keys"].device
            rows = torch.cat([ix.to(device) + self.starts[i // copies] for i, ix in enumerate(indices)])
            self._install({name: t.index_select(0, rows) for name, t in self.buffers.items()}, new_lens)
        # derived from rows that changed: dropped (the method rebuilds it) unless the state says it still holds
        self.derived = {name: kept for name, state in self.derived.items()
                    if (kept := getattr(state, "kept", lambda layer: None)(self)) is not None}
        self.evictions += 1
        self.cache._account(self.kv_nbytes() - before)

    def _rewritable(self, kept: list[int]) -> bool:
        """Whether an eviction to `kept` tokens per head may rewrite the rows in place: no other layer holds
        these buffers, no head drops more rows than an append's slack (a compression copies instead, which
        frees its memory rather than leaving it as slack), and equal lengths keep equal capacities (what a
        uniform layer's `[H, cap, ...]` views need)."""
        few = growth_slack(max(kept))
        return (self.row_sharers[0] == 1 and all(n - k <= few for n, k in zip(self.lens, kept))
                and (len(set(kept)) > 1 or len(set(self.caps)) == 1))

    @torch.inference_mode()  # buffers written in a forward are inference tensors; a rollback rewrites them after it
    def _retain_in_place(self, indices: list[torch.Tensor], kept: list[int]) -> None:
        """`retain` within the buffers: each head that drops tokens gets its kept rows moved to the front of
        its rows (in order), and the freed rows are cleared as `_install` clears slack. A head that keeps
        everything (sorted, distinct indices: `kept == lens`) is not touched."""
        device = self.buffers["keys"].device
        moved = [h for h, (k, n) in enumerate(zip(kept, self.lens)) if k != n]
        if moved:
            source = torch.cat([indices[h].to(device) + self.starts[h] for h in moved])
            dest = torch.cat([torch.arange(self.starts[h], self.starts[h] + kept[h], device=device) for h in moved])
            freed = torch.cat([torch.arange(self.starts[h] + kept[h], self.starts[h] + self.lens[h], device=device)
                               for h in moved])
            for name, buf in self.buffers.items():
                buf.index_copy_(0, dest, buf.index_select(0, source))
                buf.index_fill_(0, freed, -1 if name == "positions" else 0)
        self.lens, self.claimed = list(kept), list(kept)

    def truncate(self, logical_length: int) -> None:
        """Drop every stored token (and query) whose logical position is >= `logical_length` (rollback)."""
        view = self.head_view()
        keep = [torch.nonzero((p >= 0) & (p < logical_length)).flatten() for p in view.positions]
        if any(int(ix.numel()) != n for ix, n in zip(keep, self.lengths())):
            evictions, aux = self.evictions, self.derived
            self.retain(keep)
            self.evictions, self.derived = evictions, aux  # a rollback is not an eviction: the state truncates
        self.seen = logical_length  # before the derived state truncates: it reads what is left
        self.derived = {name: cut for name, state in self.derived.items() if (cut := state.truncate(self)) is not None}
        if self.queries is not None:
            old = self.query_positions < logical_length
            self.queries, self.query_positions = self.queries[:, old].clone(), self.query_positions[old].clone()

    def remember_queries(self, queries: torch.Tensor, window: int) -> None:
        """Keep the last `window` queries `[H_q, q, D]` of the chunk just attended (new tensors, no views)."""
        q = queries.shape[1]
        positions = torch.arange(self.seen - q, self.seen, dtype=torch.int32, device=queries.device)
        if self.queries is not None and q < window:
            queries = torch.cat([self.queries, queries], dim=1)
            positions = torch.cat([self.query_positions, positions])
        self.queries, self.query_positions = queries[:, -window:].clone(), positions[-window:].clone()

    def recent_queries(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `count` queries the layer attended with, oldest first, `[H_q, count, D]`, and their positions."""
        return self.queries[:, -count:], self.query_positions[-count:]

    # -- a decode step ---------------------------------------------------------------------------------------
    def dense_decode(self, q: torch.Tensor, scaling: float, repeats_kv: bool = False) -> torch.Tensor:
        """The one decode attention (`kernels.decode_attention`) over each head's rows in the buffers, slack
        skipped (`starts`, `lens`, `caps`). [H_kv, G, D]."""
        keys, values, starts, lens, caps = self.buffers["keys"], self.buffers["values"], self.starts, self.lens, self.caps
        if repeats_kv:
            keys, values, starts, lens, caps = self._repeated_kv(q.shape[1])
            q = q.reshape(-1, 1, q.shape[-1])
        return decode_attention(q, keys, values, scaling, starts, lens, caps)

    def _repeated_kv(self, group: int) -> tuple:
        """The layer's whole K/V buffers repeated to every query head (a new copy, as gpt-fast makes each step)."""
        if self.is_ragged:
            raise ValueError("repeated K/V is the dense baseline: it needs a uniform layer")
        n_kv, cap, dim = self.num_heads, self.caps[0], self.head_dim
        keys, values = (self.buffers[name].view(n_kv, cap, dim).repeat_interleave(group, dim=0).view(-1, dim)
                        for name in ("keys", "values"))
        heads = n_kv * group
        return keys, values, [h * cap for h in range(heads)], [self.lens[0]] * heads, [cap] * heads

    def attend_selected(self, q: torch.Tensor, view: HeadView, idx: torch.Tensor, scaling: float) -> torch.Tensor:
        return topk_attention(q, view.keys, view.values, idx, scaling, view.valid)

    def account_selected_step(self, elements: Any, recall: Any, attended: Any, selection: Selection,
                              view: HeadView) -> None:
        recall = float(recall) if isinstance(recall, torch.Tensor) else recall
        self.cache.stats.add(self, elements, recall, attended, selection.moved_bytes, selection.extra)

    def observe(self, method: StepMethod, queries: torch.Tensor, step: Step) -> None:
        """The method's observation of a chunk's queries `[H_q, n, D]` (`Method.observe`)."""
        method.observe(self, queries, step)

    def evict(self, method: StepMethod, step: Step) -> None:
        """The method's sorted indices each head keeps (`Method.keep`; None: nothing to evict), by `retain`."""
        keep = method.keep(self, self.budget, step)
        if keep is not None:
            self.retain(keep)

    def clone_into(self, cache: Cache) -> "DynamicKVLayer":
        """A layer for `cache` that shares this layer's buffers: shared rows are never rewritten, and an append
        writes in place only into slack nobody else claimed (see `claimed`)."""
        copy = DynamicKVLayer(self.layer_idx, cache)
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if k != "cache"})
        copy.cache = cache
        copy.buffers = dict(self.buffers)
        self.row_sharers[0] += 1  # the copy holds the same cell (`__dict__` above)
        copy.starts, copy.caps, copy.lens = list(self.starts), list(self.caps), list(self.lens)
        # immutable derived state is shared; state that updates in place (page summaries, CTKVR's index) is forked
        copy.derived = {name: state.fork() if hasattr(state, "fork") else state for name, state in self.derived.items()}
        return copy
