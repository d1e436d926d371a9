"""Shared pieces of the page-based selection methods (Quest, HSA, RocketKV): page summaries kept current as
tokens are appended, and the deterministic token-level top-k of page scores.

A `PageSummary` is derived state in the cache (`layer.derived`): built over what a layer holds when the segment
ends, updated incrementally on every append (only the last page and the new ones are recomputed), cut back
on a rollback, and dropped when an eviction changes the rows (the method rebuilds it). Its bounds live in
buffers with spare pages, updated in place like the cache's own rows; a prefill snapshot or a teacher-forcing
twin that shares them (`fork`) copies them before either side writes (copy on write).
"""

from __future__ import annotations

import math

import torch
from kvbench.kernels.page_summary import page_minmax

GROWTH = 0.25  # spare pages beyond those in use: a quarter more (amortised O(1) appends), as the cache's rows
MIN_SPARE_PAGES = 4


class PageSummary:
    """Element-wise min/max of the keys of every page of `page_size` consecutive rows of `length` rows.

    `kmin`/`kmax` `[H, P, D]` are views of the first P pages of buffers with spare pages at the end. An append
    rewrites the last page and writes the new ones in place, and a decode step's one row just widens its
    page's bounds (`widen`): at 8K tokens, re-concatenating both bounds and recomputing the last page every
    step cost about 3 ms of a 70 ms float32 Quest step on two cores. An object changes as its layer does.
    Objects that share buffers (`fork`) hold one `sharers` count; while it is above one, an update copies
    first. `nbytes` counts the pages in use, as the cache's `kv_bytes` counts the tokens held."""

    def __init__(self, page_size: int, kmin: torch.Tensor, kmax: torch.Tensor, length: int, pages: int | None = None):
        self.page_size = page_size
        self._kmin, self._kmax = kmin, kmax  # [H, capacity, D]
        self.length = length
        self.pages = kmin.shape[1] if pages is None else pages
        self._sharers = [1]

    @classmethod
    def of(cls, keys: torch.Tensor, page_size: int) -> "PageSummary":
        kmin, kmax = page_minmax(keys, page_size)
        pages = kmin.shape[1]
        capacity = _with_spare(pages)
        return cls(page_size, *(cls._moved(t, pages, capacity) for t in (kmin, kmax)), keys.shape[1], pages)

    kmin = property(lambda self: self._kmin[:, : self.pages])
    kmax = property(lambda self: self._kmax[:, : self.pages])

    def first_changed_row(self, length: int) -> int:
        """The first row of the first page an append or a cut to `length` rows can change."""
        return min(self.length, length) // self.page_size * self.page_size

    def fork(self) -> "PageSummary":
        """The same summary for a copy of the layer, sharing the buffers until one of them is written."""
        twin = PageSummary(self.page_size, self._kmin, self._kmax, self.length, self.pages)
        twin._sharers = self._sharers
        self._sharers[0] += 1
        return twin

    @torch.inference_mode()  # buffers built in a forward are inference tensors; a rollback updates them after it
    def update(self, tail: torch.Tensor, length: int) -> "PageSummary":
        """Now the summary of `length` rows whose rows from `first_changed_row(length)` on are `tail` [H, n, D]."""
        kept = self.first_changed_row(length) // self.page_size
        tmin, tmax = page_minmax(tail, self.page_size)
        pages = kept + tmin.shape[1]
        if self._sharers[0] > 1 or pages > self._kmin.shape[1]:
            capacity = max(_with_spare(pages), self._kmin.shape[1])
            self._kmin, self._kmax = (self._moved(buf, kept, capacity) for buf in (self._kmin, self._kmax))
            self._sharers[0] -= 1
            self._sharers = [1]
        self._kmin[:, kept:pages] = tmin
        self._kmax[:, kept:pages] = tmax
        self.pages, self.length = pages, length
        return self

    @staticmethod
    def _moved(buf: torch.Tensor, kept: int, capacity: int) -> torch.Tensor:
        new = buf.new_empty(buf.shape[0], capacity, buf.shape[2])
        new[:, :kept] = buf[:, :kept]
        return new

    def updated(self, tail: torch.Tensor, length: int) -> "PageSummary":
        """`update` on a copy: this summary stays as it is."""
        return self.fork().update(tail, length)

    @torch.inference_mode()
    def widen(self, row: torch.Tensor) -> "PageSummary":
        """Now the summary with one more row `row` [H, D] appended: its page's bounds widened in place, or a
        new page of it. Min and max select values, so this equals `update` over the page's rows."""
        page = self.length // self.page_size
        lo, hi = self._kmin[:, page], self._kmax[:, page]
        if self.length % self.page_size:
            torch.minimum(lo, row, out=lo)
            torch.maximum(hi, row, out=hi)
        else:
            lo.copy_(row)
            hi.copy_(row)
            self.pages += 1
        self.length += 1
        return self

    # -- the cache's derived-state protocol (see kvbench.cache) ------------------------------------------------
    def append(self, layer, n: int = 0) -> "PageSummary":
        owned_room = self._sharers[0] == 1 and self.length // self.page_size < self._kmin.shape[1]
        if n == 1 and owned_room and not layer.is_ragged and layer.lens[0] == self.length + 1:  # a decode step
            return self.widen(layer.keys[0, :, -1])
        keys = layer.head_view().keys
        return self.update(keys[:, self.first_changed_row(keys.shape[1]):], keys.shape[1])

    truncate = append  # a rollback cuts a suffix: the same recomputation from the first changed page

    def nbytes(self) -> int:
        return 2 * self.kmin.numel() * self.kmin.element_size()

    @property
    def paper_elements(self) -> int:  # RocketKV Table 1 counts both bounds as auxiliary storage
        return 2 * self.kmin.numel()


def _with_spare(pages: int) -> int:
    return pages + max(MIN_SPARE_PAGES, math.ceil(GROWTH * pages))


def layer_pages(layer, page_size: int) -> PageSummary:
    """The layer's page summary, built over its current keys if an eviction dropped it."""
    pages = layer.derived.get("pages")
    if pages is None or pages.page_size != page_size:
        pages = layer.derived["pages"] = PageSummary.of(layer.head_view().keys, page_size)
    return pages


def page_tokens(page_scores: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """Page scores `[..., P]` broadcast to the `length` tokens of their pages `[..., length]`."""
    return page_scores.repeat_interleave(page_size, dim=-1)[..., :length]


def top_page_tokens(page_scores: torch.Tensor, page_size: int, length: int, k: int) -> torch.Tensor:
    """`top_tokens(page_tokens(page_scores, page_size, length), k)`, sorting the P pages instead of the
    `length` tokens. Every token of a page has its page's score, so the stable token sort lists whole pages in
    the stable page order, each page's tokens in ascending order; only the pages that can reach the first k
    tokens (one may be the short last page) are expanded, and the short page's missing tokens are removed with
    a stable sort that keeps the order of the rest. The same indices in the same order, from a sort of
    `length / page_size` scores (a full token sort cost 9 ms of a 56 ms Quest step at 8K on two cores)."""
    heads, n_pages = page_scores.shape
    k = min(k, length)
    order = torch.sort(page_scores, dim=-1, descending=True, stable=True).indices
    order = order[:, : min(n_pages, k // page_size + 2)]
    tokens = (order[..., None] * page_size + torch.arange(page_size, device=order.device)).reshape(heads, -1)
    if length % page_size:
        tokens = tokens.gather(-1, torch.sort((tokens >= length).to(torch.uint8), dim=-1, stable=True).indices)
    return tokens[:, :k]


def top_tokens(token_scores: torch.Tensor, k: int) -> torch.Tensor:
    """Token-level top-k `[H, k]` of `[H, L]` scores, ties to the lowest token index (a stable sort).

    RocketKV's code selects tokens, not pages: all tokens of a page tie, so whole pages are taken and the
    boundary page is cut; with this rule it keeps its first tokens (specs/rocketkv.md §8.2)."""
    return torch.sort(token_scores, dim=-1, descending=True, stable=True).indices[:, : min(k, token_scores.shape[-1])]
