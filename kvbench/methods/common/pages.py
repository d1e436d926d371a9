"""Shared pieces of the page-based selection methods (Quest, HSA, RocketKV): page summaries kept current as
tokens are appended, and the deterministic token-level top-k of page scores.

A `PageSummary` is derived state in the cache (`layer.derived`): built over what a layer holds when the segment
ends, updated incrementally on every append (only the last page and the new ones are recomputed), cut back
on a rollback, and dropped when an eviction changes the rows (the method rebuilds it). Its bounds live in
`GrowingBuffers`, updated in place like the cache's own rows and copied before a shared copy is written.
"""

from __future__ import annotations

import torch

from kvbench.kernels.page_summary import page_minmax
from kvbench.kernels.stable_topk import stable_topk
from kvbench.methods.common.buffers import GrowingBuffers
from kvbench.methods.common.dims import RuntimeDims


class PageSummary:
    """Element-wise min/max of the keys of every page of `page_size` consecutive rows of `length` rows.

    `kmin`/`kmax` `[H, P, D]` are views of the first P pages of `GrowingBuffers`. An append rewrites the last
    page and writes the new ones in place, and a decode step's one row just widens its page's bounds
    (`widen`): at 8K tokens, re-concatenating both bounds and recomputing the last page every step cost about
    3 ms of a 70 ms float32 Quest step on two cores. An object changes as its layer does; a clone's copy is a
    `fork`. `nbytes` counts the pages in use, as the cache's `kv_bytes` counts the tokens held."""

    def __init__(self, page_size: int, bounds: GrowingBuffers, length: int, of_length: OfLength | None = None):
        self.page_size, self.bounds, self.length = page_size, bounds, length
        self.fill: torch.Tensor | None = None  # the layer's device lengths while it is static (`make_static`)
        # how `page_size` (and HSA's estimate dimensions) follow from the length the plan was made for (Quest's
        # round(2 S / t), HSA's ceil(sqrt(S / t))): the static layout then takes them as tensors (`RuntimePage`),
        # so that they are no graph constants
        self.of_length = of_length
        self.runtime: RuntimePage | None = None  # while static with `of_length`

    @classmethod
    def of(cls, keys: torch.Tensor, page_size: int, of_length: OfLength | None = None) -> "PageSummary":
        """The summary of `keys` [H, N, D]. `of_length`: when the page size is a function of the length the
        plan was made for (see `RuntimePage`)."""
        kmin, kmax = page_minmax(keys, page_size)
        return cls(page_size, GrowingBuffers([kmin, kmax], kmin.shape[1], dim=1), keys.shape[1], of_length)

    kmin = property(lambda self: self.bounds.view(0))
    kmax = property(lambda self: self.bounds.view(1))

    @property
    def pages(self) -> "int | torch.Tensor":
        """Pages in use (the longest head's): an int, or a 0-d device tensor on a static layer."""
        if self.fill is not None:
            page = self.static_page
            return (self.fill.max() + page - 1) // page
        return self.bounds.used

    @property
    def static_page(self) -> "int | torch.Tensor":
        """The page size a static step computes with: the 0-d device tensor of a `RuntimePage`, else the int."""
        return self.runtime.page if self.runtime is not None else self.page_size

    @property
    def runtime_dims(self) -> RuntimeDims | None:
        """The estimate's number of dimensions (HSA's k1) as a runtime input, on a static layer whose plan made it
        a function of the length (`kvbench.methods.common.dims`); else None."""
        return self.runtime.dims if self.runtime is not None else None

    def estimate_dims(self, planned: int) -> "int | torch.Tensor":
        """The estimate dimensions a step scores pages with: `planned`, the plan's number, or its 0-d device
        tensor (`runtime_dims`)."""
        return planned if self.runtime_dims is None else self.runtime_dims.value

    def unused_pages(self) -> torch.Tensor | None:
        """[H, P] bool: pages past each head's tokens (a static layer's capacity), None when there are none."""
        if self.fill is None:
            return None
        first_rows = torch.arange(self.kmin.shape[1], device=self.fill.device) * self.static_page
        return first_rows[None, :] >= self.fill[:, None]

    def top_tokens(self, page_scores: torch.Tensor, length: "int | torch.Tensor", k: int) -> torch.Tensor:
        """`top_page_tokens` of these pages' scores `[H, P]`: on a static layer with a runtime page by
        `RuntimePage.top_tokens` (the same tokens in the same order, no shape from the page size)."""
        if self.runtime is not None:
            return self.runtime.top_tokens(page_scores, self.fill, k)
        return top_page_tokens(page_scores, self.page_size, length, k)

    def first_changed_row(self, length: int) -> int:
        """The first row of the first page an append or a cut to `length` rows can change."""
        return min(self.length, length) // self.page_size * self.page_size

    def fork(self) -> "PageSummary":
        """The same summary for a copy of the layer, sharing the buffers until one of them is written."""
        return PageSummary(self.page_size, self.bounds.fork(), self.length, self.of_length)

    @torch.inference_mode()  # buffers built in a forward are inference tensors; a rollback updates them after it
    def update(self, tail: torch.Tensor, length: int) -> "PageSummary":
        """Now the summary of `length` rows whose rows from `first_changed_row(length)` on are `tail` [H, n, D]."""
        kept = self.first_changed_row(length) // self.page_size
        tmin, tmax = page_minmax(tail, self.page_size)
        pages = kept + tmin.shape[1]
        kmin, kmax = self.bounds.writable(kept, pages)
        kmin[:, kept:pages] = tmin
        kmax[:, kept:pages] = tmax
        self.bounds.used, self.length = pages, length
        return self

    @torch.inference_mode()
    def widen(self, row: torch.Tensor) -> "PageSummary":
        """Now the summary with one more row `row` [H, D] appended: its page's bounds widened in place, or a
        new page of it. Min and max select values, so this equals `update` over the page's rows."""
        page = self.length // self.page_size
        kmin, kmax = self.bounds.writable(self.bounds.used, page + 1)
        lo, hi = kmin[:, page], kmax[:, page]
        if self.length % self.page_size:
            torch.minimum(lo, row, out=lo)
            torch.maximum(hi, row, out=hi)
        else:
            lo.copy_(row)
            hi.copy_(row)
            self.bounds.used += 1
        self.length += 1
        return self

    def reserve(self, tokens: int) -> None:
        """Room for the pages of `tokens` more rows (the cache's `reserve`)."""
        self.bounds.reserve(-(-(self.length + tokens) // self.page_size) - self.pages)

    def updated(self, tail: torch.Tensor, length: int) -> "PageSummary":
        """`update` on a copy: this summary stays as it is."""
        return self.fork().update(tail, length)

    # -- the static decode layout (kvbench.cache.static) -----------------------------------------------------
    def make_static(self, layer) -> "PageSummary":
        """The summary at the static layer's capacity (its pages past the tokens unused, `unused_pages`), owned
        by this layer and widened in place by `append_static`. With `of_length` the page count and the
        page size are a `RuntimePage`'s: the count fixed by the capacity and the budget, the size a tensor."""
        width = layer.static.width
        runtime = (RuntimePage.at(width, self.page_size, self.of_length, layer.static.fill.device)
                   if self.of_length is not None else None)
        capacity = runtime.pages if runtime is not None else -(-width // self.page_size)
        bounds = [t.new_zeros(t.shape[0], capacity, t.shape[2]) for t in (self.kmin, self.kmax)]
        for new, old in zip(bounds, (self.kmin, self.kmax)):
            new[:, : old.shape[1]] = old
        summary = PageSummary(self.page_size, GrowingBuffers(bounds, capacity, dim=1), self.length, self.of_length)
        summary.fill, summary.runtime = layer.static.fill, runtime
        return summary

    def append_static(self, layer, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The decode token `keys` [H, D], written at each head's next slot: its page's bounds widened (a page's
        first token sets them). Fixed shapes, device indices: the same graph at every step."""
        slot, (heads, dim), page = layer.static.next_slot, keys.shape, self.static_page
        # [H, D] entries (head, page of its slot, every dimension); index_put_ so that inductor writes the graph
        # input in place (a scatter_ became a copy of the whole summary and a copy back)
        at = (torch.arange(heads, device=keys.device)[:, None], (slot // page)[:, None],
              torch.arange(dim, device=keys.device)[None, :])
        first = (slot % page == 0)[:, None]
        for bound, pick in ((self.bounds.tensors[0], torch.minimum), (self.bounds.tensors[1], torch.maximum)):
            bound.index_put_(at, torch.where(first, keys, pick(bound[at], keys)))

    def static_tensors(self) -> list[torch.Tensor]:
        return list(self.bounds.tensors)

    def make_dynamic(self, layer) -> "PageSummary":
        self.fill, self.runtime = None, None
        self.length = layer.physical_length()
        self.bounds.used = -(-self.length // self.page_size)
        return self

    # -- the cache's derived-state protocol (see kvbench.cache) ------------------------------------------------
    def append(self, layer, n: int = 0) -> "PageSummary":
        if n == 1 and not layer.is_ragged and layer.lens[0] == self.length + 1:  # a decode step's token
            return self.widen(layer.keys[0, :, -1])
        keys = layer.head_view().keys
        return self.update(keys[:, self.first_changed_row(keys.shape[1]):], keys.shape[1])

    truncate = append  # a rollback cuts a suffix: the same recomputation from the first changed page

    def nbytes(self) -> int:
        return 2 * self.kmin.numel() * self.kmin.element_size()

    @property
    def paper_elements(self) -> int:  # RocketKV Table 1 counts both bounds as auxiliary storage
        return 2 * self.kmin.numel()


class OfLength:
    """How a page-based plan's values follow from the length L it was made for (the prompt plus the tokens to
    generate; RocketKV's stage-1 capacity): the method's rule, and the plan's own values. A subclass (a frozen
    dataclass of the method's) has `k`, the tokens a step selects (a function of the budget alone), `page(L)`,
    nondecreasing in L, and `dims`: the plan's estimate dimensions where they depend on L (HSA's k1; None
    where there are none), with `most_dims(lo, hi)`, the largest of them over the lengths lo..hi."""

    k: int
    dims: int | None = None

    def page(self, length: float) -> int:
        raise NotImplementedError

    def most_dims(self, lo: int, hi: int) -> int:
        raise NotImplementedError


class RuntimePage:
    """A page size derived from the length (Quest's traffic-equivalent round(2 S / t), HSA's ceil(sqrt(S / t)))
    as a runtime input of the static decode step: the page a 0-d device tensor, the page count and the pages
    ordered by the top-k fixed by the capacity W and the rule alone. So prompts of different lengths whose loops
    share a capacity share one graph, where a page size read as a Python number made one graph per prompt length
    (12 over 12 lengths of 1K-8K tokens for Quest, 10 for HSA; `tests/test_capacity_buckets.py`). HSA's
    estimate dimensions k1 = int(D p / c2), a function of the length too, come the same way (`dims`,
    `kvbench.methods.common.dims.RuntimeDims`).

    Why the capacity fixes them: a loop's rows fit its capacity W (the smallest step of the series at or above
    them: over half of W) and its rows are at most the length L the plan was made for, so L > W / 2 and the page
    is at least `smallest = page(W / 2)` (Quest: max(1, round(W / t))). Then ceil(W / page) <= ceil(W /
    smallest) pages cover the capacity and k // page + 2 <= k // smallest + 2 pages reach the first k tokens;
    likewise the plan's dimensions are at most the most of any length in W/2..W. A loop outside that rule (a
    teacher-forced target longer than the sample's generation, a capacity of the series' floor, an L over W)
    takes its own counts: correct, one graph more."""

    def __init__(self, page: torch.Tensor, pages: int, ordered: int, width: int, dims: RuntimeDims | None = None):
        self.page, self.pages, self.ordered, self.width, self.dims = page, pages, ordered, width, dims

    @classmethod
    def at(cls, width: int, page_size: int, rule: OfLength, device: torch.device) -> "RuntimePage":
        smallest = max(1, rule.page(width / 2))
        if page_size < smallest:  # outside the rule: this page's own counts
            smallest = page_size
        pages = -(-width // smallest)
        dims = (RuntimeDims.at(rule.dims, rule.most_dims(width // 2, width), device)
                if rule.dims is not None else None)
        return cls(torch.tensor(page_size, dtype=torch.int64, device=device), pages,
                   min(pages, rule.k // smallest + 2), width, dims)

    def top_tokens(self, page_scores: torch.Tensor, fill: torch.Tensor, k: int) -> torch.Tensor:
        """`top_page_tokens(page_scores, page, fill, k)` `[H, k]` from the fixed shapes: the first `ordered` pages
        in stable descending order, then the k-th output token's page and offset computed from the page tensor.
        Only a head's last page can be partial (r = fill % page tokens); the tokens after it in that order
        move up by the page - r it lacks. A head holding fewer than k tokens gets indices past its tokens (the
        attention's validity mask drops them), clamped to the capacity."""
        heads = page_scores.shape[0]
        page = self.page
        order = stable_topk(page_scores, self.ordered)  # [H, m] pages, stable descending
        out = torch.arange(k, device=order.device)[None, :].expand(heads, k)
        partial = fill % page  # [H] tokens of the last page (0: it is whole)
        is_partial = order == (fill // page)[:, None]
        # where the partial page stands in the order (m: nowhere among the first m, or no partial page)
        where = torch.where(is_partial.any(dim=-1) & (partial > 0), is_partial.to(torch.int64).argmax(dim=-1),
                            self.ordered)
        shifted = torch.where(out >= (where * page + partial)[:, None], out + (page - partial)[:, None], out)
        tokens = order.gather(1, (shifted // page).clamp(max=self.ordered - 1)) * page + shifted % page
        return tokens.clamp(max=self.width - 1)


def plan_pages(layer, plan) -> PageSummary:
    """The layer's page summary for `plan`'s page size (`layer_pages`). A static loop's summary with a runtime page
    is built for the plan's page and is returned without reading the plan's number, which would make the page
    a constant of the compiled graph (`RuntimePage`)."""
    pages = layer.derived.get("pages")
    if pages is not None and pages.runtime is not None:
        return pages
    return layer_pages(layer, plan.derived["page_size"])


def layer_pages(layer, page_size: int) -> PageSummary:
    """The layer's page summary, built over its current keys if an eviction dropped it."""
    pages = layer.derived.get("pages")
    if pages is None or pages.page_size != page_size:
        pages = layer.derived["pages"] = PageSummary.of(layer.head_view().keys, page_size)
    return pages


def page_tokens(page_scores: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """Page scores `[..., P]` broadcast to the `length` tokens of their pages `[..., length]`."""
    return page_scores.repeat_interleave(page_size, dim=-1)[..., :length]


def top_page_tokens(page_scores: torch.Tensor, page_size: int, length: "int | torch.Tensor", k: int) -> torch.Tensor:
    """`top_tokens(page_tokens(page_scores, page_size, length), k)`, sorting the P pages instead of the
    `length` tokens. Every token of a page has its page's score, so the stable token sort lists whole pages in
    the stable page order, each page's tokens in ascending order; only the pages that can reach the first k
    tokens (one may be the short last page) are expanded, and the short page's missing tokens are removed with
    a stable sort that keeps the order of the rest. The same indices in the same order, from a top-k of the
    `length / page_size` page scores (a full token sort cost 9 ms of a 56 ms Quest step at 8K on two cores).

    On a static layer `length` is the heads' device lengths `[H]` and the scores span the capacity's pages
    (those past the tokens at -inf, so they sort last): the same indices, in fixed shapes; a head holding fewer
    than k tokens gets some past its length, which the attention's validity mask drops."""
    heads, n_pages = page_scores.shape
    static = isinstance(length, torch.Tensor)
    k = min(k, n_pages * page_size if static else length)
    order = stable_topk(page_scores, k // page_size + 2)  # the pages in stable descending order
    tokens = (order[..., None] * page_size + torch.arange(page_size, device=order.device)).reshape(heads, -1)
    if static or length % page_size:
        return held_first(tokens, tokens >= (length[:, None] if static else length), k)
    return tokens[:, :k]


def held_first(tokens: torch.Tensor, past: torch.Tensor, k: int) -> torch.Tensor:
    """The first k of `tokens` `[H, n]` once those not `past` are put first and the `past` ones after, each group
    in its order (what a stable sort of `past` orders them as): the stable top-k of 0 for a held entry and -1 for
    one past, gathered. One `topk` of int64 keys on the CPU, in that order; on CUDA one launch of the stable
    top-k operator, as a set (ascending), where the reductions that replaced a cumulative sum (which inductor
    split across blocks and, for Quest's 640 pages on an H100, failed to generate: `graph_lint`'s `SPLIT_SCAN`)
    were four kernels a layer of Quest's, HSA's and RocketKV's compiled steps (`scripts/count_step_kernels.py`)."""
    return tokens.gather(1, stable_topk(torch.where(past, -1.0, 0.0), k, ordered=False))


def top_tokens(token_scores: torch.Tensor, k: int) -> torch.Tensor:
    """Token-level top-k `[H, k]` of `[H, L]` scores, ties to the lowest token index (a stable sort's first k).

    RocketKV's code selects tokens, not pages: all tokens of a page tie, so whole pages are taken and the
    boundary page is cut; with this rule it keeps its first tokens (which tokens of the boundary page RocketKV keeps
    is not stated in its §3.4: kvbench's reading).

    `kernels.stable_topk` (one `topk` of int64 keys with no ties left to break; one Triton operator on CUDA). The
    callers attend to the chosen tokens as a set, so their order is left to the implementation (`ordered=False`):
    the reference's stable descending order on the CPU (the records' order), ascending on CUDA, where the
    kernel then skips its sort of the k. A stable sort of every score cost 1.5 ms per layer at 8K tokens on two
    CPU cores (46 ms of a SparQ step); the k-th value from a float `topk`, then two cumulative sums, a scatter
    and a sort of the k to restore the order, cost a third of that and most of the compiled step's selection."""
    return stable_topk(token_scores, k, ordered=False)
