"""InfLLM's context memory as its release computes it: thunlp/InfLLM, commit
12b70798f56e56ebb23c53c7018091a3f540a028, `inf_llm/attention/context_manager.py` (`ContextManager.append`,
`_append`, `append_global`, `get_block_k`, `calc_block_topk`, `get_global_hidden_and_mask`,
`remove_lru_blocks`), with `inf_llm/attention/dot_production_attention/torch_impl.py` (the joint softmax of the
local and global parts and the local score) and `inf_llm/attention/rope.py` (`RotaryEmbeddingESM`,
`apply_rotary_pos_emb_one_angle`); the default `cache_strategy="lru"`, `perhead=False`, no `score_decay`, no
`chunk_topk_calc`, no faiss.

One layer, batch 1, float32. Keys are stored without RoPE. Each `append(q, k, v)` is one chunk of the release's
`append` loop (one `exc_block_size` chunk: the caller cuts the input, at most n_local rows a chunk):

- local part: the last n_local stored keys and the chunk's, rotated at their relative positions (keys at
  0..len_k-1, queries at the last n), masked to distance 0..n_local-1;
- global part: the query rotated at one angle (position n_local - 1) against the unrotated keys of the top-k
  blocks (sorted by index), the initial tokens, and the first `R + n - n_local` rows of the remainder (R: the
  remainder before the chunk), masked with the release's complement window (`dist >= n_local`, `dist` offset by the
  remainder's whole length: every global row passes, also the rows still inside the window of the chunk's first
  queries, which a chunk of n > 1 rows then attends twice);
- one softmax over both parts (logits masked to -inf, then scaled by 1/sqrt(D)); the local part's probabilities,
  summed over the chunk's queries, are added to the remainder's local scores (per query head);
- block retrieval: every block while there are at most `topk`, else `topk` of `repr . mean(q_global)` over the
  flattened query heads (one set for the layer); the LRU cache (`remove_lru_blocks`, then the `lru` stamp);
- then (`append_global`) the init tokens fill from the front of the remainder once it exceeds n_local, and every
  block_size rows beyond the window become a block whose representative, per query head, is the mean of the keys
  (expanded to the query heads) of its `repr_topk` tokens with the highest local score, in `topk` order.

`attend_once=True` is not the release: it narrows the global part's remainder rows to those beyond each query's own
window, kvbench's chunked prefill, to show that this mask is the whole difference there (docs/fidelity.md).
"""

from __future__ import annotations

import math

import torch


def rope_table(dim: int, base: float | None):
    """The release's cos/sin tables (`_update_cos_sin_tables_len`): positions -> (cos, sin) `[N, D]` float32.
    `base=None`: no rotation (cos 1, sin 0), which makes the release's positions and kvbench's exactly equal."""
    inv_freq = (torch.zeros(dim // 2) if base is None
                else 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)))

    def table(positions: torch.Tensor):
        freqs = torch.outer(positions.to(torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
    return table


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, positions: torch.Tensor, table) -> torch.Tensor:
    cos, sin = table(positions)
    return x.float() * cos + _rotate_half(x).float() * sin


def _repeat(t: torch.Tensor, group: int) -> torch.Tensor:
    return t[:, None].expand(-1, group, -1, -1).reshape(t.shape[0] * group, *t.shape[1:])


class ReleaseContextManager:
    """One layer's `ContextManager` (see the module docstring)."""

    def __init__(self, n_init, n_local, block_size, topk, repr_topk, max_cached_block, table,
                 attend_once: bool = False):
        self.n_init, self.n_local, self.block_size, self.topk = n_init, n_local, block_size, topk
        self.repr_topk, self.max_cached_block, self.table = repr_topk, max_cached_block, table
        # not the release: `attend_once` masks the global part's remainder rows to those beyond each query's own
        # window (distance >= n_local), so a chunk's first queries attend every row once (kvbench's chunked
        # prefill); used only to show that this mask is the whole difference
        self.attend_once = attend_once
        self.length = 0
        self.init_exc = False
        self.cached: dict[int, int] = {}
        self.load_count = 0
        self.blocks: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (keys, values, start position)
        self.block_k: list[torch.Tensor] = []  # representatives [H_q, D]
        self.repr_positions: list[list[list[int]]] = []  # per block, per query head: the representative tokens
        self.steps: list[dict] = []  # per chunk: the retrieved blocks (sorted) and the LRU misses

    def _setup(self, q, k):
        heads_kv, _, dim = k.shape
        self.heads, self.heads_kv, self.dim = q.shape[0], heads_kv, dim
        empty = k.new_zeros(heads_kv, 0, dim)
        self.local_k, self.local_v = empty, empty
        self.rem_k, self.rem_v, self.rem_pos = empty, empty, torch.zeros(0, dtype=torch.long)
        self.rem_score = k.new_zeros(self.heads, 0)
        self.init_k, self.init_v = empty, empty

    def append(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q `[H_q, n, D]`, k/v `[H_kv, n, D]` (pre-RoPE), n <= n_local: the chunk's output `[H_q, n, D]`."""
        if self.length == 0:
            self._setup(q, k)
        n, group = q.shape[1], q.shape[0] // k.shape[0]
        assert n <= self.n_local  # the release's `exc_block_size <= n_local`
        self.local_k, self.local_v = torch.cat((self.local_k, k), 1), torch.cat((self.local_v, v), 1)
        rem_ed = self.rem_k.shape[1]  # the remainder before this chunk (the release's `_global_remainder_ed`)
        self.rem_k, self.rem_v = torch.cat((self.rem_k, k), 1), torch.cat((self.rem_v, v), 1)
        self.rem_pos = torch.cat((self.rem_pos, self.length + torch.arange(n)))
        self.rem_score = torch.cat((self.rem_score, self.rem_score.new_zeros(self.heads, n)), 1)
        global_q = _rope(q, torch.tensor([self.n_local - 1]), self.table)  # `apply_rotary_pos_emb_one_angle(q, n_local)`

        # _append: the local part
        kv_length = self.local_k.shape[1]
        kv_st = max(kv_length - n - self.n_local, 0)
        lk, lv = self.local_k[:, kv_st:], self.local_v[:, kv_st:]
        len_k = lk.shape[1]
        lq_h = _rope(q, torch.arange(len_k - n, len_k), self.table)
        lk_h = _rope(lk, torch.arange(len_k), self.table)
        dist = torch.arange(n)[:, None] - torch.arange(len_k)[None, :] + (len_k - n)
        local_mask = (dist < self.n_local) & (dist >= 0)
        local_logits = (lq_h @ _repeat(lk_h, group).transpose(-1, -2)).masked_fill(~local_mask, float("-inf"))
        local_logits = local_logits * (1 / math.sqrt(self.dim))

        # calc_block_topk and the LRU cache
        if len(self.blocks) <= self.topk:
            chosen = list(range(len(self.blocks)))
        else:
            reprs = torch.stack(self.block_k).reshape(len(self.blocks), self.heads * self.dim)
            chosen = (reprs @ global_q.mean(dim=1).reshape(-1)[:, None]).squeeze(-1).topk(self.topk).indices.tolist()
        misses = [b for b in chosen if b not in self.cached]
        num_remove = len(self.cached) - self.max_cached_block + len(misses)
        if num_remove > 0:
            for b, _ in sorted(self.cached.items(), key=lambda item: item[1]):
                if b not in chosen:
                    self.cached.pop(b)
                    num_remove -= 1
                if num_remove <= 0:
                    break
        self.load_count += 1
        for b in chosen:
            self.cached[b] = self.load_count
        chosen = sorted(chosen)
        self.steps.append({"blocks": chosen, "misses": len(misses)})

        # get_global_hidden_and_mask: blocks, init, the remainder beyond the last query's window
        rem_len = max(rem_ed + n - self.n_local, 0)
        gk = torch.cat([self.blocks[b][0] for b in chosen] + [self.init_k, self.rem_k[:, :rem_len]], 1)
        gv = torch.cat([self.blocks[b][1] for b in chosen] + [self.init_v, self.rem_v[:, :rem_len]], 1)
        rmd_st = len(chosen) * self.block_size + self.init_k.shape[1]
        gdist = torch.arange(n)[:, None] - torch.arange(gk.shape[1])[None, :] + (self.rem_k.shape[1] + rmd_st)
        global_mask = gdist >= self.n_local  # complement_sliding_window
        if self.attend_once:
            true_dist = rem_ed + torch.arange(n)[:, None] - torch.arange(rem_len)[None, :]
            global_mask = global_mask & torch.cat((torch.ones(n, rmd_st, dtype=torch.bool), true_dist >= self.n_local), 1)
        global_logits = (global_q @ _repeat(gk, group).transpose(-1, -2)).masked_fill(~global_mask, float("-inf"))
        global_logits = global_logits * (1 / math.sqrt(self.dim))

        # the torch implementation's finalize: one softmax, the local part's score
        p = torch.softmax(torch.cat((local_logits, global_logits), -1), dim=-1)
        p_local = p[..., :len_k].masked_fill(~local_mask, 0)
        p_global = p[..., len_k:].masked_fill(~global_mask, 0)
        out = torch.zeros_like(q)
        out += p_local @ _repeat(lv, group)
        out += p_global @ _repeat(gv, group)
        self._append_global(n, p_local.sum(dim=-2))
        self.length += n
        if self.local_k.shape[1] >= self.n_local:
            self.local_k, self.local_v = self.local_k[:, -self.n_local:], self.local_v[:, -self.n_local:]
        return out

    def _append_global(self, exc_length: int, local_score: torch.Tensor) -> None:
        ed = self.rem_k.shape[1]
        local_score = local_score[:, -exc_length - self.n_local:]
        self.rem_score[:, ed - local_score.shape[-1]:ed] += local_score
        st, rem_len = 0, ed
        if not self.init_exc and rem_len > self.n_local:
            take = min(self.n_init - self.init_k.shape[1], rem_len - self.n_local)
            self.init_k = torch.cat((self.init_k, self.rem_k[:, :take]), 1)
            self.init_v = torch.cat((self.init_v, self.rem_v[:, :take]), 1)
            st, rem_len = take, rem_len - take
            if self.init_k.shape[1] == self.n_init:
                self.init_exc = True
        group = self.heads // self.heads_kv
        while rem_len - self.block_size >= self.n_local:
            rem_len -= self.block_size
            rows = slice(st, st + self.block_size)
            keys = self.rem_k[:, rows]
            self.blocks.append((keys, self.rem_v[:, rows], int(self.rem_pos[st])))
            top = self.rem_score[:, rows].topk(self.repr_topk, dim=-1).indices  # get_block_k
            expanded = _repeat(keys, group)
            picked = torch.gather(expanded, -2, top[..., None].expand(-1, -1, self.dim))
            self.block_k.append(picked.mean(dim=-2))
            self.repr_positions.append((self.rem_pos[rows][top]).tolist())
            st += self.block_size
        self.rem_k, self.rem_v = self.rem_k[:, st:], self.rem_v[:, st:]
        self.rem_pos, self.rem_score = self.rem_pos[st:], self.rem_score[:, st:]
