"""OmniKV (Hao et al., ICLR 2025; seed paper 004): dynamic context selection shared across layers, no token
dropped (specs/omnikv.md).

At every decode step, each filter layer (0-based, `filter_layers`, ≤ 3) scores the prompt tokens with its
own current query before its own (dense) attention: the max over all query heads of the scaled logits (the
released code's `last` selector; `score_space=softmax` is the paper's Eq. 3), and keeps the top `budget`
(k) as one sorted index set shared by every KV head. Every later layer up to the next filter layer attends
to those prompt tokens plus every token generated since (never dropped); the `wait_layers` (1) right after
a filter layer and the layers before the first one attend densely. `dense_layers` may make more layers dense,
but no filter layer (the layers after it need its selection).

`offload=true` is the Context Bank: the prompt KV of the sparse layers moves to host memory when the prompt
ends and only the selected rows come back each step (bytes moved are recorded); results equal
`offload=false` bit for bit, since both attend to the same rows through the same path (the selected prompt
rows and the generated tail, merged by log-sum-exp). The prompt is every token stored when the prompt (or a
later turn's input) ends; a question appended after the compressed segment counts as prompt too. The
paper's optional chunked "OmniKV-prefill" (App. D.10) is not implemented; its prefill is the dense one.

Budget: by default the budget is k, the prompt tokens each sparse layer attends (spec §3.3 item 7). The
paper compares with eviction baselines at equal GPU memory instead (§4.1): `budget_unit=memory` reads the
budget as Mem% of the prompt's KV, dense layers included, so k = N (Mem - f) / (1 - f) with N the prompt and
f the share of dense layers, (L_0 + |filter| (1 + W)) / L in the paper's terms (Llama-3-8B, {2, 8, 18}:
f = 0.25, Mem 30% -> k = 6.7% of N). A Mem% below f leaves k = 0: the record's `budget_plan` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.core.checks import is_int
from kvbench.core.contract import Plan, Schedule, Selection
from kvbench.methods.base import Method, register_method
from kvbench.methods.common.placement import HostSegment, recall_of


@register_method
@dataclass
class OmniKV(Method):
    name = "omnikv"
    family = "selection"
    selects = True
    filter_layers: list[int] = field(default_factory=lambda: [2, 8, 18])  # Llama-3-8B's {2, 8, 18}
    wait_layers: int = 1
    score_space: str = "logits"
    offload: bool = False
    budget_unit: str | None = None  # null/tokens: the budget is k; memory: it is the paper's Mem% (module doc)

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = self.filter_layers
        if not isinstance(layers, (list, tuple)) or not layers or not all(is_int(x) and x >= 0 for x in layers) \
                or list(layers) != sorted(set(layers)):
            raise ValueError(f"filter_layers must be increasing layer indices (0-based), got {layers!r}")
        if any(self.is_dense_layer(f) for f in layers):
            raise ValueError(f"dense_layers {self.dense_layers!r} include a filter layer of {list(layers)}: a filter "
                             "layer attends densely already, and the layers after it need its selection")
        if not is_int(self.wait_layers) or self.wait_layers < 0:
            raise ValueError(f"wait_layers must be a number of layers >= 0, got {self.wait_layers!r}")
        if self.score_space not in ("logits", "softmax"):
            raise ValueError(f"score_space must be logits or softmax, not {self.score_space!r}")
        if self.budget_unit not in (None, "tokens", "memory"):
            raise ValueError(f"budget_unit must be tokens, memory or null, not {self.budget_unit!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload must be true or false, got {self.offload!r}")

    def schedule(self) -> Schedule:
        # the events only mark where the prompt ends (and move the sparse layers' prompt KV to the bank)
        return Schedule(block_size=None, decode_every=0, every_turn=True)

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan(evict=None, select=None, derived={"full_attention": True})
        derived = {"k": budget, "filter_layers": list(self.filter_layers)}
        if self.budget_unit == "memory":
            if num_layers is None:
                raise ValueError("budget_unit=memory needs the model's number of layers")
            prompt = sequence_length - new_tokens
            dense = self.dense_share(num_layers)
            k = max(0, round((budget - dense * prompt) / (1 - dense))) if dense < 1 else prompt
            derived.update(k=min(k, prompt), memory_share=budget / prompt, dense_share=dense)
        return Plan(evict=budget, select=budget, derived=derived)

    def dense_share(self, num_layers: int) -> float:
        """f: the share of layers that keep and attend to their whole prompt (before the first filter layer,
        filter and wait layers, and `dense_layers`)."""
        return sum(self.role(i) != "sparse" or self.is_dense_layer(i) for i in range(num_layers)) / num_layers

    def role(self, layer_idx: int) -> str:
        if layer_idx < self.filter_layers[0]:
            return "dense"
        if layer_idx in self.filter_layers:
            return "filter"
        if any(0 < layer_idx - f <= self.wait_layers for f in self.filter_layers):
            return "wait"
        return "sparse"

    def keep(self, layer, budget, step):
        step.shared["omnikv_prompt"] = layer.seen
        if not self.offload or self.role(layer.layer_idx) != "sparse":
            return None
        view = layer.head_view()
        layer.derived["bank"] = HostSegment.of(view.keys, view.values, view.positions,
                                           torch.arange(view.keys.shape[1]), layer.derived.get("bank"))
        return [torch.zeros(0, dtype=torch.long, device=view.keys.device)] * layer.num_heads

    def select(self, layer, q, view, step, scaling):
        shared = step.shared
        prompt = shared.get("omnikv_prompt")
        role = self.role(layer.layer_idx)
        if prompt is None or role in ("dense", "wait"):
            return None
        if role == "filter":
            logits = torch.einsum("hgd,hnd->hgn", q.float(), view.keys[:, :prompt].float()) * scaling
            if self.score_space == "softmax":
                logits = torch.softmax(logits, dim=-1)
            score = logits.flatten(0, 1).amax(dim=0)  # max over every query head: one set for the layer
            shared["omnikv_selected"] = score.topk(min(step.plan.derived["k"], prompt)).indices.sort().values
            return None
        chosen = shared["omnikv_selected"]
        heads, group, _ = q.shape
        bank = layer.derived.get("bank")
        if bank is not None:  # the Context Bank: the selected rows come back from host memory
            keys, values = (t.index_select(1, chosen.to(t.device)).to(q.device) for t in (bank.keys, bank.values))
            tail = torch.arange(view.keys.shape[1], device=q.device)
            moved = 2 * keys.numel() * keys.element_size() if bank.keys.device != q.device else 0
            host = bank
        else:
            keys, values = view.keys.index_select(1, chosen), view.values.index_select(1, chosen)
            tail = torch.arange(prompt, view.keys.shape[1], device=q.device)
            moved, host = 0, None
        recall = None
        if step.measure_recall:  # over every token the layer holds: storage (+ the bank)
            if host is None:
                everything, rows = view.keys, torch.cat([chosen, tail])
            else:
                everything = torch.cat([view.keys, host.keys.to(q.device)], dim=1)
                rows = torch.cat([tail, view.keys.shape[1] + chosen])
            recall = recall_of(q, everything, rows[None].expand(heads, -1), None, scaling)
        return Selection(tail.expand(heads, group, -1), external=(keys, values), recall=recall, moved_bytes=moved)

    def offloaded(self, layer):
        return layer.derived.get("bank")

    def step_traffic(self, layer, selection, step):
        if selection is None or selection.external is None:
            return super().step_traffic(layer, None, step)
        heads = selection.idx.shape[0]
        return 2 * layer.head_dim * heads * (selection.idx.shape[-1] + selection.external[0].shape[1])
