"""SparQ attention (Ribar et al. 2024): estimate the scores from the r largest-|q| head dimensions, attend
exactly to the top-k tokens, blend with the mean value (RocketKV's baseline, its App. A.3).

Per decode step: the r dimensions of largest |q| (ties to the lower dimension); approximate logits
q[r] . K[:, r] read from a second, transposed copy of the keys (`[H, D, N]`, kept current as tokens are
appended: SparQ stores K twice); a softmax with SparQ's temperature sqrt(D * sum_r |q| / sum |q|) instead of
sqrt(D); exact attention over the top-k tokens; with `reallocation` (on, as the SparQ code) the output is
    w * attention(top-k) + (1 - w) * mean(V),  w = the estimated attention mass of the top-k,
with mean(V) over every stored token (a running sum kept with the transposed keys).

GQA (the SparQ code repeats K over the group and selects per query head): `granularity=group` (default)
chooses the dimensions from |q| summed over the group and one top-k from the group-mean estimate, so a
group reads the budget t, the unit RocketKV compares at; `granularity=head` is the code's per-query-head
selection, which reads up to G times more (the record's traffic says so).

Budget (per KV group and step, estimate included; the SparQ code's `get_r_k_for_compression_ratio`): with
c = S / t, r = round(D / c) (at least 1) and k = round(t / 2). A budget at or above S is full attention.

Against both releases on the same tensors (sparq-gpt-fast: `granularity=head`; llm-inference-research, the
paper's code, which always keeps the newest token and ranks a group by its summed logits): docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.core.contract import Plan, Selection
from kvbench.kernels.reduced_scores import reduced_scores, reduced_scores_reference
from kvbench.methods.base import SelectionMethod, register_method
from kvbench.methods.common.buffers import GrowingBuffers
from kvbench.methods.common.dims import RuntimeDims, summed, top_dims, zero_past
from kvbench.methods.common.pages import top_tokens


def sparq_dims(length: float, budget: int, head_dim: int) -> int:
    """SparQ's r for a budget t at length L: round(D / c), c = L / t, at least 1 (`get_r_k_for_compression_ratio`)."""
    return max(1, min(head_dim, round(head_dim / (length / budget))))


@dataclass(frozen=True)
class SparQDims:
    """SparQ's r as a function of the length L its plan was made for, and the plan's r (`dims`): the static
    step takes it as a runtime input (`kvbench.methods.common.dims`), so a sweep over prompt lengths does not
    compile a graph per value of r."""

    budget: int
    head_dim: int
    dims: int

    def most_dims(self, lo: int, hi: int) -> int:
        return sparq_dims(lo, self.budget, self.head_dim)  # r falls as L grows


class TransposedKeys:
    """SparQ's second copy of the keys, `[H, D, N]` (a view of `GrowingBuffers`: an append writes its columns
    in place rather than re-concatenating the whole copy), and the running sum of the values (fp32). `of_length`:
    how the plan's r follows from the length (a runtime input of the static step, `runtime_dims`)."""

    def __init__(self, columns: GrowingBuffers, value_sum: torch.Tensor, of_length: SparQDims | None = None):
        self.columns, self.value_sum, self.of_length = columns, value_sum, of_length  # value_sum [H, D]
        self.fill: torch.Tensor | None = None  # the layer's device lengths while it is static (`make_static`)
        self.runtime_dims: RuntimeDims | None = None  # while static with `of_length`

    @classmethod
    def of(cls, layer, of_length: SparQDims | None = None) -> "TransposedKeys":
        view = layer.head_view()
        keys_t = view.keys.transpose(1, 2).contiguous()  # the second copy of K, SparQ's storage cost
        return cls(GrowingBuffers([keys_t], keys_t.shape[2], dim=2), view.values.float().sum(dim=1), of_length)

    keys_t = property(lambda self: self.columns.view(0))

    @property
    def length(self) -> "int | torch.Tensor":
        """Columns holding keys (the longest head's): an int, or a 0-d device tensor on a static layer."""
        return self.fill.max() if self.fill is not None else self.columns.used

    def make_static(self, layer) -> "TransposedKeys":
        """The copy at the static layer's capacity (columns past a head's tokens unused), owned by this layer."""
        width = layer.static.width
        keys_t = self.keys_t.new_zeros(self.keys_t.shape[0], self.keys_t.shape[1], width)
        keys_t[:, :, : self.columns.used] = self.keys_t
        state = TransposedKeys(GrowingBuffers([keys_t], width, dim=2), self.value_sum.clone(), self.of_length)
        state.fill = layer.static.fill
        if self.of_length is not None:
            rule = self.of_length
            state.runtime_dims = RuntimeDims.at(rule.dims, rule.most_dims(width // 2, width), state.fill.device)
        return state

    def append_static(self, layer, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The decode token's key [H, D] written as column `next_slot` of every head, its value summed in."""
        heads, dim = keys.shape
        # index_put_, not scatter_: inductor writes an index_put_ into the graph input in place, while a scatter_
        # became a copy of the whole [H, D, capacity] buffer and a copy back, every layer and step
        at = (torch.arange(heads, device=keys.device)[:, None], torch.arange(dim, device=keys.device)[None, :],
              layer.static.next_slot[:, None])
        self.columns.tensors[0].index_put_(at, keys)
        self.value_sum.add_(values.float())

    def static_tensors(self) -> list[torch.Tensor]:
        return [*self.columns.tensors, self.value_sum]

    def make_dynamic(self, layer) -> "TransposedKeys":
        self.fill, self.runtime_dims = None, None
        self.columns.used = layer.physical_length()
        return self

    @torch.inference_mode()  # the buffers are inference tensors when built in a forward
    def append(self, layer, n: int) -> "TransposedKeys":
        view = layer.head_view()
        new_keys, new_values = view.keys[:, -n:], view.values[:, -n:]
        (keys_t,) = self.columns.writable(self.length, self.length + n)
        keys_t[:, :, self.length:self.length + n] = new_keys.transpose(1, 2)
        self.columns.used += n
        self.value_sum = self.value_sum + new_values.float().sum(dim=1)
        return self

    def reserve(self, tokens: int) -> None:
        self.columns.reserve(tokens)

    def truncate(self, layer) -> "TransposedKeys":
        return TransposedKeys.of(layer, self.of_length)

    def fork(self) -> "TransposedKeys":
        return TransposedKeys(self.columns.fork(), self.value_sum, self.of_length)

    def nbytes(self) -> int:
        return self.keys_t.numel() * self.keys_t.element_size() + self.value_sum.numel() * 4

    @property
    def paper_elements(self) -> int:  # RocketKV Table 1: SparQ's storage is 2x (K stored twice)
        return self.keys_t.numel()


@register_method
@dataclass
class SparQ(SelectionMethod):
    name = "sparq"
    static_selection = True
    reallocation: bool = True
    granularity: str = "group"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.granularity not in ("group", "head"):
            raise ValueError(f"granularity must be group or head, not {self.granularity!r}")

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
        r = sparq_dims(sequence_length, budget, head_dim)
        return Plan(evict=None, select=budget, derived={"r": r, "k2": max(1, round(budget / 2))})

    def build_derived(self, layer, step):
        plan = step.plan
        if not plan.select:
            return {}
        return {"keys_t": TransposedKeys.of(layer, SparQDims(plan.select, layer.head_dim, plan.derived["r"]))}

    def _state(self, layer) -> TransposedKeys:
        if "keys_t" not in layer.derived:
            layer.derived["keys_t"] = TransposedKeys.of(layer)
        return layer.derived["keys_t"]

    def select(self, layer, q, view, step, scaling):
        r, k = step.plan.derived["r"], step.plan.derived["k2"]
        state = self._state(layer)
        if k >= view.width:
            return None
        heads, group, dim = q.shape
        absq = q.float().abs()
        # r dimensions, or on a static layer a fixed number of them with those past r zeroed (a runtime r)
        if self.granularity == "group":
            top = top_dims(absq.sum(dim=1), r, state.runtime_dims)  # [H, r]
            dims = top.dims
            estimate = reduced_scores(zero_past(q, top), state.keys_t, dims)  # [H, G, N]
            chosen = summed(absq.gather(-1, dims[:, None, :].expand(heads, group, dims.shape[1])), top.past)
        else:  # per query head: each head is its own group of one over a shared copy of its KV head's keys
            top = top_dims(absq, r, state.runtime_dims)  # [H, G, r]
            flat = top.dims.reshape(heads * group, -1)
            keys_t = state.keys_t.repeat_interleave(group, dim=0)
            rows = zero_past(q, top).reshape(heads * group, 1, dim)
            estimate = reduced_scores_reference(rows, keys_t, flat).view(heads, group, -1)
            chosen = summed(absq.gather(-1, top.dims), top.past)
        temperature = torch.sqrt(dim * chosen / absq.sum(-1))[..., None]
        if view.valid is not None:  # a static layer's columns past its tokens
            estimate = estimate.masked_fill(~view.valid[:, None, :], float("-inf"))
        s_hat = torch.softmax(estimate / temperature, dim=-1)  # [H, G, N]
        if self.granularity == "group":
            idx = top_tokens(s_hat.mean(dim=1), k)[:, None, :].expand(heads, group, -1)
        else:
            idx = top_tokens(s_hat.reshape(heads * group, -1), k).view(heads, group, -1)
        if not self.reallocation:
            return idx
        mass = s_hat.gather(-1, idx).sum(-1, keepdim=True)  # [H, G, 1]
        length = view.width if view.lengths is None else view.lengths[:, None]
        return Selection(idx, weight=mass, fallback=(state.value_sum / length)[:, None, :])

    def step_traffic(self, layer, selection, step):
        if selection is None:
            return super().step_traffic(layer, None, step)
        state = self._state(layer)
        r = step.plan.derived["r"] if state.runtime_dims is None else state.runtime_dims.value
        heads, group = selection.idx.shape[:2]
        estimate = heads * (group if self.granularity == "head" else 1) * r * state.length
        mean_value = heads * layer.head_dim if self.reallocation else 0
        if self.granularity == "group":  # a group's k distinct tokens: what `distinct_rows` would count, without
            # its zeroed mask, scatter and sum (two of a compiled step's kernels per layer on an H200, docs/journal/gpu.md)
            attended = 2 * layer.head_dim * heads * selection.idx.shape[-1]
        else:
            attended = super().step_traffic(layer, selection, step)
        return estimate + attended + mean_value
