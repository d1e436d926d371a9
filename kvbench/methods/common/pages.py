"""Shared pieces of the page-based selection methods (Quest, HSA, RocketKV): page summaries kept current as
tokens are appended, and the deterministic token-level top-k of page scores.

A `PageSummary` is derived state in the cache (`layer.derived`): built over what a layer holds when the segment
ends, updated incrementally on every append (only the last page and the new ones are recomputed), cut back
on a rollback, and dropped when an eviction changes the rows (the method rebuilds it). Objects are never
modified in place, so a prefill snapshot or a teacher-forcing twin can share one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbench.kernels.page_summary import page_minmax


@dataclass(frozen=True)
class PageSummary:
    """Element-wise min/max of the keys of every page of `page_size` consecutive rows of `length` rows."""

    page_size: int
    kmin: torch.Tensor  # [H, P, D]
    kmax: torch.Tensor  # [H, P, D]
    length: int

    @classmethod
    def of(cls, keys: torch.Tensor, page_size: int) -> "PageSummary":
        kmin, kmax = page_minmax(keys, page_size)
        return cls(page_size, kmin, kmax, keys.shape[1])

    def first_changed_row(self, length: int) -> int:
        """The first row of the first page an append or a cut to `length` rows can change."""
        return min(self.length, length) // self.page_size * self.page_size

    def updated(self, tail: torch.Tensor, length: int) -> "PageSummary":
        """The summary of `length` rows whose rows from `first_changed_row(length)` on are `tail` [H, n, D]."""
        kept = self.first_changed_row(length) // self.page_size
        tmin, tmax = page_minmax(tail, self.page_size)
        return PageSummary(self.page_size, torch.cat([self.kmin[:, :kept], tmin], dim=1),
                           torch.cat([self.kmax[:, :kept], tmax], dim=1), length)

    # -- the cache's derived-state protocol (see kvbench.cache) ------------------------------------------------
    def append(self, layer, n: int = 0) -> "PageSummary":
        keys = layer.head_view().keys
        return self.updated(keys[:, self.first_changed_row(keys.shape[1]):], keys.shape[1])

    truncate = append  # a rollback cuts a suffix: the same recomputation from the first changed page

    def nbytes(self) -> int:
        return 2 * self.kmin.numel() * self.kmin.element_size()

    @property
    def paper_elements(self) -> int:  # RocketKV Table 1 counts both bounds as auxiliary storage
        return 2 * self.kmin.numel()

    @property
    def pages(self) -> int:
        return self.kmin.shape[1]


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
