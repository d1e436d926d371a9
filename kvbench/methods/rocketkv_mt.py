"""RocketKV-MT (the RocketKV paper, arXiv:2502.14051, §3.7): RocketKV for multi-turn, keeping the whole
history.

Nothing is evicted. At the end of every prefill (the first prompt and each later turn's input, which
attends to the full history) SnapKV runs over the whole history and selects `prompt_budget` tokens per KV
head; the selection is kept as an index list with page summaries over the selected keys (Table 1 assumes no
second copy of K/V). Decode steps append to the history and to the selection, and HSA runs over the
selection only. The next turn throws the selection away and selects again from the full history. Traffic is
RocketKV's; storage is the full history plus the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import register_method
from kvbench.methods.common.pages import PageSummary
from kvbench.methods.hsa import hsa_select
from kvbench.methods.rocketkv import RocketKV


@dataclass(frozen=True)
class Selected:
    """A layer's SnapKV selection over the full history: storage rows `[H, n]` and their page summaries."""

    rows: torch.Tensor
    pages: PageSummary

    @classmethod
    def of(cls, layer, rows: torch.Tensor, page_size: int) -> "Selected":
        return cls(rows, PageSummary.of(_gather(layer, rows), page_size))

    def append(self, layer, n: int) -> "Selected":
        length = layer.physical_length()
        new = torch.arange(length - n, length, device=self.rows.device).expand(self.rows.shape[0], n)
        rows = torch.cat([self.rows, new], dim=1)
        first = self.pages.first_changed_row(rows.shape[1])
        return Selected(rows, self.pages.updated(_gather(layer, rows[:, first:]), rows.shape[1]))

    def truncate(self, layer) -> None:
        return None  # the next turn's end selects again from the history

    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.pages.nbytes()

    @property
    def paper_elements(self) -> int:
        return self.pages.paper_elements


def _gather(layer, rows: torch.Tensor) -> torch.Tensor:
    keys = layer.head_view().keys
    return keys.gather(1, rows[..., None].expand(-1, -1, keys.shape[-1]))


@register_method
@dataclass
class RocketKVMT(RocketKV):
    name = "rocketkv_mt"
    static_selection = False  # its selection indexes the full history through a row list (`Selected`)
    window: int = 128  # SCBench, the multi-turn benchmark it is for (single-turn RocketKV: 32)

    def keep(self, layer, budget, step):
        layer.derived.pop("selected", None)
        chosen = super().keep(layer, budget, step)
        if chosen is not None:
            rows = torch.stack(chosen)  # uniform: SnapKV keeps `budget` tokens in every KV head
            layer.derived["selected"] = Selected.of(layer, rows, step.plan.derived["page_size"])
        return None  # the full history stays

    def select(self, layer, q, view, step, scaling):
        selected = layer.derived.get("selected")
        if selected is None:  # nothing was filtered (the history fits the stage-1 budget): plain HSA
            return super().select(layer, q, view, step, scaling)
        d = step.plan.derived
        heads, group, _ = q.shape
        n = selected.rows.shape[1]
        if d["k2"] >= n:
            return selected.rows[:, None, :].expand(heads, group, n)
        local = hsa_select(q, selected.pages, d["k1"], d["k2"], n, self.selection.dtype)[:, 0]
        return selected.rows.gather(1, local)[:, None, :].expand(heads, group, local.shape[1])

    def step_traffic(self, layer, selection, step):
        selected = layer.derived.get("selected")
        if selection is None or selected is None:
            return super().step_traffic(layer, selection, step)
        heads = selection.idx.shape[0]
        return heads * (selected.pages.pages * step.plan.derived["k1"] + 2 * layer.head_dim * selection.idx.shape[-1])

    def build_derived(self, layer, step):
        return {} if "selected" in layer.derived else super().build_derived(layer, step)

