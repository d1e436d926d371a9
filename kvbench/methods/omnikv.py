"""OmniKV (Hao et al., "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs", ICLR 2025): dynamic
context selection shared across layers, no token dropped. Compared with the release (antgroup/OmniKV) in
docs/fidelity.md.

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
later turn's input) ends; a question appended after the compressed segment counts as prompt too.

Context selectors (§4.2, `selector`): `last` (the current query alone, the default and the released code's
recommendation), `uniform` and `exp` over the window of the last `window` (16) queries, current included, as
the release's `select_tokens_by_attn_universal` and `OmniKVMulLayer` compute them: the window's own prompt
tokens (the last n of the prompt) are kept outright, the candidates are the prompt without them, k shrinks by
n (to at least 1, as the release: k <= n attends n + 1), and s = sum_j alpha_j max_h softmax_candidates(Q_j K^T)
(alpha_j = 1, or 2^(j - (w - 1)) with the newest 1), summed query by query, oldest first (the release's
running sum, halved before each newer query for exp). One departure: each window query keeps the RoPE of its
own position (the release rotates every window query with the current position; docs/fidelity.md).

`scoring_dtype` (kvbench.methods.common.arithmetic): null/float32 scores in float32; `release` computes the
logits, softmax and sums in float16 as the release does (its models are loaded in float16).

OmniKV-prefill (App. D.10, `prefill_chunk`): the compressed segment is fed in chunks of `prefill_chunk`
tokens; in each chunk every filter layer scores the past tokens with the `uniform` selector over the chunk's
queries (sum over the chunk of the max over query heads of the softmax over the past) and keeps the top
r x chunk tokens (`prefill_ratio`, r = 2 recommended); the sparse layers of its segment attend causally to those
tokens plus the chunk itself, the others densely. The paper gives neither the chunk size nor the masking:
the chunk is a parameter (4096 in the presets; null: the dense prefill) and the softmax runs over the past tokens
only. Nothing is dropped: the whole prompt is stored, and decoding is OmniKV's.

Ablations (Table 7, App. D.5, `ablation`): `without_selector` removes the Context Selector: every sparse layer
attends to its whole prompt, which with `offload=true` comes back from the bank at every step (the paper's "Brutal
Offload": accuracy of full attention, 569 ms/token against OmniKV's 54). `without_bank` removes the inter-layer
sharing (the paper: "we do not apply inter-layer attention similarity, we can only utilize the Context Selector at
each layer"): every sparse layer scores its whole prompt with its own query and the configured selector and attends
to its own top k (184 ms/token: a full score pass per layer). The paper does not say which layers stay dense in
this ablation; the dense prefix, filter and wait layers are kept as in OmniKV, so the dense share, the memory
budget and k are the same and only the source of each sparse layer's set changes. With `offload=true` a layer's
scoring reads its whole prompt keys from the bank.

Budget: by default the budget is k, the prompt tokens each sparse layer attends (the paper's §3.3). The
paper compares with eviction baselines at equal GPU memory instead (§4.1): `budget_unit=memory` reads the
budget as Mem% of the prompt's KV, dense layers included, so k = N (Mem - f) / (1 - f) with N the prompt and
f the share of dense layers, (L_0 + |filter| (1 + W)) / L in the paper's terms (Llama-3-8B, {2, 8, 18}:
f = 0.25, Mem 30% -> k = 6.7% of N). A Mem% below f leaves k = 0: the record's `budget_plan` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.core.contract import Plan, Schedule, Selection
from kvbench.methods.base import SelectionMethod, register_method
from kvbench.methods.common.arithmetic import check_scoring_dtype, scoring_dtype
from kvbench.methods.common.placement import HostSegment, recall_of


@register_method
@dataclass
class OmniKV(SelectionMethod):
    name = "omnikv"
    filter_layers: list[int] = field(default_factory=lambda: [2, 8, 18])  # Llama-3-8B's {2, 8, 18}
    wait_layers: int = 1
    score_space: str = "logits"
    offload: bool = False
    budget_unit: str | None = None  # null/tokens: the budget is k; memory: it is the paper's Mem% (module doc)
    # null defaults keep the point identities of runs made before these options existed
    selector: str | None = None  # null/last | uniform | exp (§4.2)
    window: int | None = None  # queries the uniform and exp selectors weigh; null: the paper's 16
    prefill_chunk: int | None = None  # OmniKV-prefill's chunk (App. D.10); null: the dense prefill
    prefill_ratio: float | None = None  # OmniKV-prefill's r: past tokens kept per chunk token; null: 2
    ablation: str | None = None  # null | without_selector | without_bank: Table 7's ablations (module doc)
    scoring_dtype: str | None = None  # null/float32 | release: the selectors' scores in float16, as the release

    def static_decode_blocker(self) -> str | None:
        if self.offload:
            return "OmniKV's Context Bank sits in host memory: every decode step loads the selected rows from it"
        return super().static_decode_blocker()

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = self.filter_layers
        if not layers or any(x < 0 for x in layers) or list(layers) != sorted(set(layers)):
            raise ValueError(f"filter_layers must be increasing layer indices (0-based), got {layers!r}")
        if any(self.is_dense_layer(f) for f in layers):
            raise ValueError(f"dense_layers {self.dense_layers!r} include a filter layer of {list(layers)}: a filter "
                             "layer attends densely already, and the layers after it need its selection")
        if self.wait_layers < 0:
            raise ValueError(f"wait_layers must be a number of layers >= 0, got {self.wait_layers!r}")
        if self.score_space not in ("logits", "softmax"):
            raise ValueError(f"score_space must be logits or softmax, not {self.score_space!r}")
        if self.budget_unit not in (None, "tokens", "memory"):
            raise ValueError(f"budget_unit must be tokens, memory or null, not {self.budget_unit!r}")
        if self.selector not in (None, "last", "uniform", "exp"):
            raise ValueError(f"selector must be last, uniform, exp or null, not {self.selector!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be a positive number of queries or null, got {self.window!r}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive number of tokens or null, got {self.prefill_chunk!r}")
        if self.prefill_ratio is not None and self.prefill_ratio <= 0:
            raise ValueError(f"prefill_ratio must be a positive number or null, got {self.prefill_ratio!r}")
        if self.ablation not in (None, "without_selector", "without_bank"):
            raise ValueError(f"ablation must be without_selector, without_bank or null, not {self.ablation!r}")
        check_scoring_dtype(self.scoring_dtype)

    @property
    def context_selector(self) -> str:
        return self.selector or "last"

    @property
    def window_size(self) -> int:
        return self.window or 16

    @property
    def obs_window(self) -> int:
        return 0 if self.context_selector == "last" else self.window_size - 1  # the current query is the last

    def schedule(self) -> Schedule:
        # the events only mark where the prompt ends (and move the sparse layers' prompt KV to the bank)
        return Schedule(block_size=self.prefill_chunk, decode_every=0, every_turn=True)

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
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
            if self.ablation is None:  # the ablations never read the filter layers' choice
                shared["omnikv_selected"] = self._choose(layer, q, view.keys[:, :prompt], prompt, step, scaling)
            return None
        heads, group, _ = q.shape
        bank = layer.derived.get("bank")
        if self.ablation == "without_selector":  # every prompt token (from the bank: Brutal Offload)
            chosen = torch.arange(prompt, device=q.device)
        elif self.ablation == "without_bank":  # this layer's own choice, scored over its whole prompt
            prompt_keys = bank.keys.to(q.device) if bank is not None else view.keys[:, :prompt]
            chosen = self._choose(layer, q, prompt_keys, prompt, step, scaling)
        else:
            chosen = shared["omnikv_selected"]
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

    def _choose(self, layer, q, prompt_keys, prompt, step, scaling) -> torch.Tensor:
        """The filter layer's sorted prompt-token set for this decode step (the context selector)."""
        k = min(step.plan.derived["k"], prompt)
        dtype = scoring_dtype(self.scoring_dtype, torch.float16)
        if self.context_selector == "last":
            if dtype == torch.float32:
                logits = torch.einsum("hgd,hnd->hgn", q.float(), prompt_keys.float()) * scaling
            else:  # the release: fp16 product divided by sqrt(D)
                logits = torch.einsum("hgd,hnd->hgn", q.to(dtype), prompt_keys.to(dtype)) / (1 / scaling)
            if self.score_space == "softmax":
                logits = torch.softmax(logits, dim=-1)
            score = logits.flatten(0, 1).amax(dim=0)  # max over every query head: one set for the layer
            return score.topk(k).indices.sort().values
        queries = q.reshape(-1, 1, q.shape[-1])  # [H_q, 1, D]: query head h * G + g
        past, past_positions = layer.queries, layer.query_positions
        width = self.window_size
        if past is not None and width > 1:
            queries = torch.cat([past[:, -(width - 1):], queries], dim=1)
            positions = torch.cat([past_positions[-(width - 1):], past_positions.new_tensor([layer.seen - 1])])
        else:
            positions = torch.tensor([layer.seen - 1], device=q.device)
        # the release's range: the window's own prompt tokens (the prompt's last n) are kept outright, only the
        # rest are scored (the softmax runs over them alone), and k shrinks by n, to at least one token
        in_window = int((positions < prompt).sum())
        candidates = prompt - in_window
        score = _window_score(queries, prompt_keys[:, :candidates], q.shape[0], scaling, self.context_selector, dtype)
        top = score.topk(min(max(1, k - in_window), candidates)).indices
        forced = torch.arange(candidates, prompt, device=top.device)
        return torch.cat([top, forced]).sort().values

    # -- OmniKV-prefill: a prompt chunk's sparse layers attend to the filter layer's choice plus the chunk ----
    def chunk_context(self, layer, query, step, scaling):
        if self.prefill_chunk is None:
            return None
        role, q_len = self.role(layer.layer_idx), query.shape[1]
        if role in ("dense", "wait"):
            return None
        keys, values = self._past(layer, q_len)
        past = keys.shape[1]
        if role == "filter":
            k = round((self.prefill_ratio or 2.0) * q_len)
            chosen = None
            if k < past:
                score = _max_head_probs(query, keys, layer.num_heads, scaling, torch.float32).sum(dim=0)
                chosen = score.topk(k).indices.sort().values
            step.shared["omnikv_prefill_selected"] = chosen
            return None
        chosen = step.shared.get("omnikv_prefill_selected")
        if chosen is None:
            return None  # everything past fits the ratio: dense
        return keys.index_select(1, chosen.to(keys.device)), values.index_select(1, chosen.to(values.device))

    @staticmethod
    def _past(layer, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token before the chunk, in position order: the bank's rows, then the storage's."""
        view = layer.head_view()
        keys, values = view.keys[:, : view.keys.shape[1] - q_len], view.values[:, : view.values.shape[1] - q_len]
        bank = layer.derived.get("bank")
        if bank is not None:
            keys = torch.cat([bank.keys.to(keys.device), keys], dim=1)
            values = torch.cat([bank.values.to(values.device), values], dim=1)
        return keys, values

    def offloaded(self, layer):
        return layer.derived.get("bank")

    def step_traffic(self, layer, selection, step):
        if selection is None or selection.external is None:
            return super().step_traffic(layer, None, step)
        heads = selection.idx.shape[0]
        return 2 * layer.head_dim * heads * (selection.idx.shape[-1] + selection.external[0].shape[1])


def _max_head_probs(queries: torch.Tensor, keys: torch.Tensor, kv_heads: int, scaling: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """max_h softmax(Q_j K^T) for each of the queries `[H_q, w, D]` over the keys `[H_kv, n, D]`: `[w, n]`, in
    `dtype` (float32; float16: the release's arithmetic, the product divided by sqrt(D) as the release does)."""
    heads, width, dim = queries.shape
    grouped = queries.reshape(kv_heads, heads // kv_heads * width, dim).to(dtype)
    logits = torch.einsum("hqd,hnd->hqn", grouped, keys.to(dtype))
    logits = logits * scaling if dtype == torch.float32 else logits / (1 / scaling)
    return torch.softmax(logits, dim=-1).view(heads, width, -1).amax(dim=0)


def _window_score(queries: torch.Tensor, keys: torch.Tensor, kv_heads: int, scaling: float, selector: str,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """s = sum_j alpha_j max_h softmax(Q_j K^T) over the window's queries `[H_q, w, D]` (oldest first) and keys
    `[H_kv, n, D]` (uniform: alpha = 1; exp: 2^(j - (w - 1)), the newest 1): `[n]` in `dtype`. Summed as the
    release sums, query by query (exp: the running sum halved before each newer query's scores are added), so
    the float32 scores are the release's own values, not only the same up to rounding."""
    best = _max_head_probs(queries, keys, kv_heads, scaling, dtype)
    total = best[0]
    for row in best[1:]:
        total = (total * 0.5 if selector == "exp" else total) + row
    return total
