"""Page summaries and page-level score bounds (Quest, and RocketKV's hybrid sparse attention).

Pages are consecutive runs of `page_size` stored tokens of one KV head, starting at row 0; the last page may
be partial. A page's summary is the element-wise min and max of its keys. `page_scores` bounds each page's
attention logit from a query without reading its keys: per chosen head dimension, the query times the page
max where the sign says positive, times the page min otherwise (Quest with all dimensions and each query
head's own signs; HSA with the k1 dimensions of largest group |q| and the group's signs).

Each function dispatches between a Triton kernel or operator (CUDA) and its PyTorch reference, which documents
the semantics; both compute the same function.
"""

from __future__ import annotations

import torch

from kvbench.kernels._dispatch import use_triton
from kvbench.kernels.group_scores import group_scores, group_scores_applies


def page_minmax(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`page_minmax_reference`'s result, computed by the Triton kernel when `use_triton` allows it."""
    impl = page_minmax_triton if use_triton(keys) else page_minmax_reference
    return impl(keys, page_size)


def page_minmax_reference(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of every page of keys (PyTorch).

    keys: [H, N, D]. Returns (kmin, kmax), each [H, P, D] in keys' dtype with P = ceil(N / page_size);
    page j covers rows j*page_size .. min(N, (j+1)*page_size) - 1 (a partial last page summarises only its
    real rows). N = 0 gives P = 0.
    """
    heads, n, dim = keys.shape
    pages = -(-n // page_size)
    pad = pages * page_size - n
    if pad:  # pad with the page's own last row: min/max unchanged
        keys = torch.cat([keys, keys[:, -1:].expand(heads, pad, dim)], dim=1)
    paged = keys.view(heads, pages, page_size, dim)
    return paged.amin(dim=2), paged.amax(dim=2)


def page_minmax_triton(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`page_minmax_reference` as a Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from kvbench.kernels._triton_kernels import launch_page_minmax

    return launch_page_minmax(keys, page_size)


def page_scores(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, dims: torch.Tensor | None, positive: torch.Tensor
) -> torch.Tensor:
    """`page_scores_reference`'s result: by the group-scores operator on CUDA, eagerly and inside the compiled
    step alike (`page_scores_by_group_scores`), by `page_scores_traced` inside a compiled step elsewhere, by the
    reference otherwise (the CPU's records)."""
    if group_scores_applies(q, kmin, kmax, positive):
        return page_scores_by_group_scores(q, kmin, kmax, dims, positive)
    if torch.compiler.is_compiling():
        return page_scores_traced(q, kmin, kmax, dims, positive)
    return page_scores_reference(q, kmin, kmax, dims, positive)


def page_scores_reference(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, dims: torch.Tensor | None, positive: torch.Tensor
) -> torch.Tensor:
    """Sign-aware page score bounds over chosen head dimensions (PyTorch).

    q: [H, G, D] (query head h*G + g uses KV head h); kmin/kmax: [H, P, D]; dims: [H, k1] int64 head
    dimensions (shared by the group), or None for all D in order; positive: [H, G, k1] bool (or [H, 1, k1],
    broadcast over the group), which bound each dimension reads. Returns [H, G, P] fp32:
    out[h, g, p] = sum_j q[h, g, dims[h, j]] * (kmax if positive[h, g, j] else kmin)[h, p, dims[h, j]].
    With all dimensions and positive = q > 0 this is Quest's bound, >= q . k for every key k of the page.
    """
    heads, group, dim = q.shape
    if dims is None:  # no gather: the same contiguous values an identity gather copies (bitwise)
        k1 = dim
        q_sel, lo, hi = q.float(), kmin.float(), kmax.float()
    else:
        k1 = dims.shape[1]
        q_sel = q.float().gather(2, dims[:, None, :].expand(heads, group, k1))  # [H, G, k1]
        lo = kmin.gather(2, dims[:, None, :].expand(heads, kmin.shape[1], k1)).float()  # [H, P, k1]
        hi = kmax.gather(2, dims[:, None, :].expand(heads, kmax.shape[1], k1)).float()
    pos = positive.expand(heads, group, k1)
    # split by bound so that no [H, G, P, k1] tensor is built; each product is the bmm that
    # einsum("hgk,hpk->hgp") runs (bitwise the same), without einsum's parsing on every decode step
    return torch.bmm(q_sel * pos, hi.transpose(1, 2)) + torch.bmm(q_sel * ~pos, lo.transpose(1, 2))


def page_scores_traced(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, dims: torch.Tensor | None, positive: torch.Tensor
) -> torch.Tensor:
    """`page_scores_reference` written for inductor (the compiled decode step), equal up to float rounding.

    Over every dimension (Quest's bound, dims None), each query head's bound is one reduction over the head
    dimension of q times the bound its sign picks, which inductor generates as one kernel reading the bounds in
    their own dtype. The reference's two products were, on an H100, two fp32 copies of both bounds and two
    cuBLAS batched GEMVs at every step: 14 us per layer of Quest's step for 2.6 MB of bounds (docs/journal/gpu.md,
    section 5).

    With chosen dimensions (HSA's, RocketKV's), the query is zeroed outside them instead of the bounds being
    gathered on them, so both products read whole contiguous bounds through BLAS: the same sum (the other terms
    are exact zeros) in another order. Inductor turned the reference's gather of k1 of D columns of every page
    into scalar loads: 90 us per layer for 512 pages on two cores (bf16 RocketKV at 8K). It reads all D columns
    of the bounds, not k1: the method's traffic (its cost model) is what the paper's kernel reads. (The one
    reduction of Quest's form, summed in inductor's order, moved a near-tie of RocketKV's pages on a tiny model,
    0.02 off the eager logits, where these products keep it within 1e-4.)"""
    heads, group, dim = q.shape
    if dims is None:
        bound = torch.where(positive.expand(heads, group, dim)[:, :, None, :], kmax[:, None], kmin[:, None])
        return (q.float()[:, :, None, :] * bound.float()).sum(-1)  # [H, G, P, D] fused into the sum, never stored
    chosen = torch.zeros(heads, dim, dtype=torch.bool, device=q.device).scatter(1, dims, True)  # [H, D]
    sign = torch.zeros(heads, group, dim, dtype=torch.bool, device=q.device).scatter(
        2, dims[:, None, :].expand(heads, group, -1), positive.expand(heads, group, -1))  # positive, on chosen
    q_on = q.float() * chosen[:, None, :]
    return torch.bmm(q_on * sign, kmax.float().transpose(1, 2)) + torch.bmm(q_on * ~sign, kmin.float().transpose(1, 2))


def page_scores_by_group_scores(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, dims: torch.Tensor | None, positive: torch.Tensor
) -> torch.Tensor:
    """`page_scores_reference` as two products of the `kvbench::group_scores` operator (CUDA), equal up to the
    order of float sums.

    The sign picks a dimension's bound, so the score is (q where positive) . kmax + (q elsewhere) . kmin over
    the chosen dimensions: each product reads the chosen dimensions of one bound, the bounds transposed by a
    view (`[H, D, P]`), once per KV group, on tensor cores, with no fp32 copy of either bound. What it replaces:
    eagerly, a per-query-head Triton kernel (40 us for 16 of 128 dimensions of 8 x 8,192 pages, 66 us for
    Quest's bound over 8 x 2,048 pages, on an H100: docs/journal/gpu.md section 2); in the compiled step, inductor's
    reduction with the rotary embedding inlined (Quest: 11 us a layer for 2.6 MB of bounds on an H200, section
    7), and for HSA's and RocketKV's chosen dimensions two fp32 copies of both bounds and two batched GEMVs.
    A dimension chosen twice must have one sign (every caller's sign is that of q, or of its group sum, there)."""
    heads, group, dim = q.shape
    if dims is None:
        sign = positive
    else:  # the chosen dimensions' signs at their places among the D (the operator gathers q at `dims`), by a
        # comparison, not a scatter: inductor fuses it with both halves of the query into one kernel
        at = dims[:, None, :, None] == torch.arange(dim, device=q.device)  # [H, 1, k1, D]
        sign = (at & positive[..., None]).any(dim=2)  # [H, G or 1, D]
    zero = q.new_zeros(())
    return (group_scores(torch.where(sign, q, zero), kmax.transpose(1, 2), dims)
            + group_scores(torch.where(sign, zero, q), kmin.transpose(1, 2), dims))
