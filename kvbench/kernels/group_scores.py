"""Attention logits of a KV group's query heads over every key, from all head dimensions or a chosen few, on CUDA.

Exact-TopK ranks every key by its exact logit (`kernels.exact_scores`), SparQ by the logit over the r head
dimensions of largest |q| (`kernels.reduced_scores`). Both are one product of the group's query heads with the
keys. Inside the compiled step on an H200 they were inductor's code: Exact-TopK's a reduction at 3.6x the time
of reading the layer's keys once, SparQ's an fp32 GEMM after a gather of the chosen rows, 27 us a layer for
reads of under 1 us (docs/journal/gpu.md section 7). The kernel here reads each key (or each chosen dimension's row of the
transposed keys) once per KV group, as one tensor-core product with the group padded to 16 rows, as
`kvbench.kernels.flash_decode` does. It is registered as a PyTorch operator (`kvbench::group_scores`, with a fake
implementation), so that the compiled step captures it as one node; on CUDA the eager path runs the same
operator, so both paths compute the same logits. On the CPU the references stay the path (records and graphs
unchanged); the kernel runs there only in Triton's interpreter, in the tests.

Not yet run on a GPU (written in a session without one; `gpu_session.sh selection` times SparQ's and
Exact-TopK's compiled steps with it). A launch that raises falls back to the reference, with one warning line.
"""

from __future__ import annotations

import torch

from kvbench.kernels._dispatch import LaunchFallback, triton_launchable

FALLBACK = LaunchFallback("group_scores", "PyTorch's product")


def group_scores_applies(*tensors: torch.Tensor) -> bool:
    """Whether the scores of these tensors go to the operator (CUDA, triton installed, `KVBENCH_KERNELS` not
    "torch"): also inside `torch.compile`, which captures the operator."""
    return triton_launchable(*tensors)


def group_scores(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor | None = None) -> torch.Tensor:
    """out[h, g, n] = sum over j of q[h, g, dims[h, j]] * keys_t[h, dims[h, j], n], in float32; every dimension
    when `dims` is None. q: [H, G, D]; keys_t: [H, D, N], any strides (the keys transposed by a view, or
    SparQ's transposed copy); dims: [H, r] int64."""
    return torch.ops.kvbench.group_scores(q, keys_t, dims)


def group_scores_reference(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor | None = None) -> torch.Tensor:
    """Dot products of the queries with every key over chosen dimensions only (PyTorch), or over all of them.

    q: [H, G, D]; keys_t: [H, D, N] (keys transposed); dims: [H, r] int64 dimensions shared by the group, or None.
    Returns [H, G, N] fp32: out[h, g, n] = sum_j q[h, g, dims[h, j]] * keys_t[h, dims[h, j], n].
    """
    if dims is None:
        return torch.einsum("hgd,hdn->hgn", q.float(), keys_t.float())
    heads, group, _ = q.shape
    r = dims.shape[1]
    q_sel = q.float().gather(2, dims[:, None, :].expand(heads, group, r))  # [H, G, r]
    k_sel = keys_t.gather(1, dims[:, :, None].expand(heads, r, keys_t.shape[2])).float()  # [H, r, N], r rows only
    return torch.bmm(q_sel, k_sel)


@torch.library.custom_op("kvbench::group_scores", mutates_args=())
def _group_scores_op(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor | None) -> torch.Tensor:
    heads, _, dim = q.shape
    if keys_t.dim() != 3 or keys_t.shape[:2] != (heads, dim) or (dims is not None and dims.shape[0] != heads):
        raise ValueError(f"group_scores: q {tuple(q.shape)}, keys_t {tuple(keys_t.shape)}, dims "
                         f"{None if dims is None else tuple(dims.shape)}: expected [H, G, D], [H, D, N], [H, r]")

    def launch():
        from kvbench.kernels._group_scores_kernels import launch_group_scores  # triton on the first launch

        return launch_group_scores(q, keys_t, dims)

    return FALLBACK.run(launch, lambda: group_scores_reference(q, keys_t, dims))


@_group_scores_op.register_fake
def _(q, keys_t, dims):
    return q.new_empty((q.shape[0], q.shape[1], keys_t.shape[2]), dtype=torch.float32)
