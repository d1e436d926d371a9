"""CTKVR (Lu et al., "CTKVR: Efficient KV Cache Retrieval for Long-Context LLMs via Centroid-then-Token
Indexing"): centroid-then-token KV retrieval over a query-centric inverted file.

Nothing is dropped. When the prompt's prefill ends, per layer (CTKVR §3.1.1, Algorithm 1):

- the last C post-RoPE queries become centroids, C = min(`max_centroids`, s // 16) (`centroid_positions`:
  final; Table 4's ablation takes them from the start (init), evenly spaced (equi) or at random positions drawn
  from the sample's generator (random) instead);
- each centroid's top-rho keys (rho = 2.5 rho') by the max over its GQA group of each query head's own softmax
  probability (fp32, causal: a centroid never indexes its future), initial and local tokens excluded, form
  its inverted list (the qcIVF); built in chunks of `build_chunk` centroids so memory stays bounded;
- the middle of the prompt, [n_init, s - n_local), moves off the accelerator (host memory, pinned when CUDA
  is present); the initial and local tokens stay resident, and every generated token is appended there.

Every decode step, per layer (Algorithm 2, §2.3):

1. recall: cosine of the query with every centroid (per query head, max over the group), the top C'
   centroids, the union of their lists without duplicates (its size is the paper's alpha * C' * rho);
2. rerank: softmax of the query over the recalled keys only, max over the group, the top rho' (= budget);
3. attention over those rho' host rows, merged exactly by log-sum-exp with attention over the resident set
   (initial + local + generated): the two sets are disjoint;
4. DCU: the query and its top-rho reranked keys replace the oldest centroid (a FIFO of capacity C);
   `dcu: false` leaves the index as the prompt built it (Table 5's "w/o DCU").

A stage-timed profile (`profiler.stages=true`) times these as Table 13's modules: `select/recall` (Q2Q(c)
recall), `select/rerank` (Q2K rerank), `select/gather` and `attention/external` (the host-side attention: the
rho' rows copied out of the host segment, then attended), `attention/stored` (the resident set) and `select/dcu`.

Placement: the host segment lives on the CPU; with CUDA the resident set stays on the GPU and only the query,
the host side's partial output and its log-sum-exp cross. The paper's co-execution (the resident attention on
the GPU while the CPU recalls and reranks) is not reproduced: recall and rerank run first, then both
attentions, one after the other, so a CUDA decode time here is an upper bound of the paper's. On a CPU-only
machine both sides are the same device and no second copy exists: the record's bytes say which. Later chunks (the question, a new turn) go token by token through this decode path
(`turn_index=dcu`, kvbench's reading of §3.1.3's DCU: each token also enters the index, unless `dcu` is false), or are attended the same way and the index
is rebuilt from the turn's last C queries when it ends (`turn_index=rebuild`).

Choices where the paper is silent (kvbench's, docs/fidelity.md): n_init 64; n_local null = 5% of the prompt, at least C (the
paper's only hint is "about 5% of the KV stays on the GPU" at 128K, which this reproduces at every length;
a fixed 1024 would keep a 2K prompt nearly dense), a number fixes it; the records' read traffic
counts the resident tokens next to rho'. Indices only point into the host segment, so the sets merge
disjointly; all layers use CTKVR (`dense_layers` keeps some dense). Table 4's rules (§4.3.1) say only "from
the beginning", "evenly spaced", "random": INIT takes queries 0..C-1, EQUI rounds C points spaced evenly from
the first query to the last, RANDOM draws C distinct positions once per prompt (the same in every layer and
head); a centroid still indexes only keys at or before its position, so an INIT centroid among the first
n_init queries sees no host key and lists host rows at random, until DCU replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvbench.core.contract import Schedule, Selection
from kvbench.core.stages import stage
from kvbench.methods.base import OffloadMethod, register_method
from kvbench.methods.common.derived import FixedState
from kvbench.methods.common.placement import HostSegment, resident_and_host_recall


@dataclass
class QueryIndex(FixedState):
    """The qcIVF: centroid queries [H_q, C, D] (post-RoPE), each KV head's inverted lists [H, C, rho] of host
    rows (-1: empty), and the FIFO slot the next decode query overwrites. DCU updates it in place, so a
    copy of the cache forks it (`fork`). Centroids are queries, not tokens: a rollback does not remove them."""

    centroids: torch.Tensor
    lists: torch.Tensor
    pointer: int = 0

    def fork(self) -> "QueryIndex":
        return QueryIndex(self.centroids.clone(), self.lists.clone(), self.pointer)

    def push(self, query: torch.Tensor, rows: torch.Tensor) -> None:
        """DCU: the query [H_q, D] and its lists [H, rho] replace the oldest centroid."""
        self.centroids[:, self.pointer] = query
        self.lists[:, self.pointer] = rows.to(self.lists.dtype)
        self.pointer = (self.pointer + 1) % self.centroids.shape[1]


CENTROID_POSITIONS = ("final", "init", "equi", "random")


def centroid_count(max_centroids: int, prompt: int) -> int:
    """C = min(max_centroids, s // 16), at least one."""
    return min(max_centroids, max(1, prompt // 16))


def default_local(centroids: int, prompt: int) -> int:
    """n_local's default (null): 5% of the prompt, at least C."""
    return max(centroids, round(0.05 * prompt))


@dataclass
class CentroidPool(FixedState):
    """The C prompt queries [H_q, C, D] (post-RoPE) and positions [C] that a `centroid_positions` other than
    final picks while the prompt is attended (`CTKVR.observe`); the index build right after consumes it."""

    queries: torch.Tensor
    positions: torch.Tensor


def centroid_rows(rule: str, queries: int, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """Which `count` of a segment's `queries` rows become centroids, ascending (Table 4: FINAL, the last;
    INIT, the first; EQUI, evenly spaced from the first to the last; RANDOM, uniform without replacement)."""
    if rule == "final":
        return torch.arange(queries - count, queries)
    if rule == "init":
        return torch.arange(count)
    if rule == "equi":
        return torch.linspace(0, queries - 1, count, dtype=torch.float64).round().long()
    return torch.randperm(queries, generator=generator)[:count].sort().values


def build_index(
    centroids: torch.Tensor,
    centroid_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    host: torch.Tensor,
    rho: int,
    scaling: float,
    chunk: int,
) -> torch.Tensor:
    """Algorithm 1: each centroid's top-`rho` host rows, [H, C, rho] int32 (score order not kept).

    centroids [H_q, C, D]; keys [H, n, D] with positions [H, n]; host [H, n] bool marks the candidate rows,
    numbered 0.. in storage order among the host rows. Scores are each query head's own softmax over every
    key it may see (causal), the max over its group; processed `chunk` centroids at a time.
    """
    heads, n, dim = keys.shape
    group = centroids.shape[0] // heads
    host_row = torch.cumsum(host.long(), dim=1) - 1  # storage index -> host row
    rho = min(rho, int(host.sum(dim=1).min()))
    lists = []
    for start in range(0, centroids.shape[1], chunk):
        q = centroids[:, start:start + chunk].float()
        c = q.shape[1]
        logits = torch.einsum("hgcd,hnd->hgcn", q.view(heads, group, c, dim), keys.float()) * scaling
        future = key_positions[:, None, None, :] > centroid_positions[start:start + c][None, None, :, None]
        probs = torch.softmax(logits.masked_fill_(future, float("-inf")), dim=-1).amax(dim=1)  # [H, c, n]
        top = probs.masked_fill_(~host[:, None, :], float("-inf")).topk(rho, dim=-1).indices
        lists.append(host_row.gather(1, top.reshape(heads, -1)).view(heads, c, rho))
    return torch.cat(lists, dim=1).to(torch.int32)  # the paper's 4 bytes per entry


@register_method
@dataclass
class CTKVR(OffloadMethod):
    name = "ctkvr"
    host_work = "CTKVR recalls from its inverted index and reads rows from host memory at every decode step"
    steps_through_chunks: ClassVar[bool] = True
    max_centroids: int = 2048  # C = min(max_centroids, s // 16)
    retrieved_centroids: int = 4  # C'
    list_ratio: float = 2.5  # rho = list_ratio * rho'
    n_init: int = 64
    n_local: int | None = None  # null: 5% of the prompt, at least C
    turn_index: str = "dcu"  # dcu: turn tokens enter the index through DCU; rebuild: Algorithm 1 at each turn end
    build_chunk: int = 256  # centroids scored at once while building the qcIVF
    centroid_positions: str | None = None  # the prompt queries that become centroids: final (None), init, equi, random
    dcu: bool | None = None  # dynamic centroid update at every decode step (None: on); false: Table 5's w/o DCU

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_centroids", "retrieved_centroids", "build_chunk"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_init", "n_local"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be a number of tokens >= 0{' or null' if name == 'n_local' else ''}, "
                                 f"got {value!r}")
        if self.list_ratio < 1:
            raise ValueError(f"list_ratio (rho / rho') must be a number >= 1, got {self.list_ratio!r}")
        if self.turn_index not in ("dcu", "rebuild"):
            raise ValueError(f"turn_index must be dcu or rebuild, not {self.turn_index!r}")
        if self.centroid_positions is not None and self.centroid_positions not in CENTROID_POSITIONS:
            raise ValueError(f"centroid_positions must be one of {', '.join(CENTROID_POSITIONS)} (null: final), "
                             f"not {self.centroid_positions!r}")
        if self.observes and self.turn_index == "rebuild":
            raise ValueError("centroid_positions other than final need turn_index=dcu (a rebuild indexes the turn's "
                             "last queries)")

    @property
    def observes(self) -> bool:  # the rules other than final pick their centroids while the prompt is attended
        return self.centroid_positions not in (None, "final")

    @property
    def obs_window(self) -> int:
        return 0 if self.observes else self.max_centroids

    def observe(self, layer, queries, step):
        """Keep the C queries [H_q, q, D] of the segment just attended that `centroid_positions` names: the same
        positions in every layer (random: one draw per segment, the first layer's, shared through `step.shared`)."""
        count = min(centroid_count(self.max_centroids, layer.seen), queries.shape[1])
        segment = (layer.seen, queries.shape[1], count)
        drawn = step.shared.get("ctkvr_centroid_rows")
        if drawn is None or drawn[0] != segment:
            drawn = step.shared["ctkvr_centroid_rows"] = (
                segment, centroid_rows(self.centroid_positions, queries.shape[1], count, step.generator))
        rows = drawn[1].to(queries.device)
        first = layer.seen - queries.shape[1]
        layer.derived["centroid_pool"] = CentroidPool(queries.index_select(1, rows), (first + rows).to(torch.int32))

    def schedule(self) -> Schedule:
        # the "eviction" events move the prompt's middle to host memory and build the index: with
        # turn_index=rebuild at each turn's end too
        return Schedule(block_size=None, decode_every=0, every_turn=self.turn_index == "rebuild")

    def plan_derived(self, budget, prompt):
        centroids = centroid_count(self.max_centroids, prompt)
        local = self.n_local if self.n_local is not None else default_local(centroids, prompt)
        return {"rho_prime": budget, "rho": int(self.list_ratio * budget), "retrieved_centroids": self.retrieved_centroids,
                "centroids": centroids, "n_init": self.n_init, "n_local": local}

    # -- prefill end (and turn ends with turn_index=rebuild): offload the middle, build the qcIVF -------------
    def keep(self, layer, budget, step):
        pool = layer.derived.pop("centroid_pool", None)
        view = layer.head_view()
        positions = view.positions
        first_local = layer.seen - step.plan.derived["n_local"]
        old = layer.derived.get("host")
        moving = (positions >= self.n_init) & (positions < first_local)
        if (old is None or old.positions.shape[1] == 0) and not bool(moving.any()):
            return None  # the prompt is all initial and local tokens: nothing to retrieve
        if pool is not None:
            queries, query_positions = pool.queries, pool.positions
        else:
            centroids = min(centroid_count(self.max_centroids, layer.seen), layer.queries.shape[1])
            queries, query_positions = layer.queries[:, -centroids:], layer.query_positions[-centroids:]
        keys, values = view.keys, view.values
        all_keys, all_positions = keys, positions
        if old is not None:  # a rebuild indexes every key: the earlier host rows come first in position order
            all_keys = torch.cat([old.keys.to(keys.device), keys], dim=1)
            all_positions = torch.cat([old.positions.to(positions.device), positions], dim=1)
        host = (all_positions >= self.n_init) & (all_positions < first_local)
        lists = build_index(queries, query_positions, all_keys, all_positions, host,
                            int(self.list_ratio * budget), layer.scaling, self.build_chunk)
        moving_rows = torch.nonzero(moving[0]).flatten()
        layer.derived["host"] = HostSegment.of(keys, values, positions, moving_rows, old)
        layer.derived["index"] = QueryIndex(queries.clone(), lists)
        resident = torch.nonzero(~moving[0]).flatten()
        return [resident] * layer.num_heads

    # -- decode ---------------------------------------------------------------------------------------------
    def select(self, layer, q, view, step, scaling):
        host, index = layer.derived.get("host"), layer.derived.get("index")
        if host is None or index is None:
            return None
        heads, group, dim = q.shape
        n_res = view.keys.shape[1]
        resident = torch.arange(n_res, device=q.device).expand(heads, group, n_res)
        top_lists = min(step.plan.derived["retrieved_centroids"], index.centroids.shape[1])
        with stage("recall"):  # Table 13's Q2Q(c) recall
            rows, valid = self._recall(q, index, top_lists)
        with stage("rerank"):  # Table 13's Q2K rerank
            host_q = q.to(host.keys.device)
            recalled = host.keys.gather(1, rows.clamp(min=0).to(host.keys.device)[..., None].expand(-1, -1, dim))
            logits = torch.einsum("hgd,hrd->hgr", host_q.float(), recalled.float()) * scaling
            logits.masked_fill_(~valid.to(logits.device)[:, None, :], float("-inf"))
            score = torch.softmax(logits, dim=-1).amax(dim=1)  # [H, R]: softmax over the recalled set, max over group
            rho_prime, rho = step.plan.derived["rho_prime"], index.lists.shape[2]
            order = score.sort(dim=-1, descending=True, stable=True).indices
            ranked_rows, ranked_valid = rows.gather(1, order.to(rows.device)), valid.gather(1, order.to(valid.device))
            chosen, chosen_valid = ranked_rows[:, :rho_prime], ranked_valid[:, :rho_prime]
        with stage("gather"):  # the rho' host rows copied out for the host-side attention (the paper reads them in place)
            gather = chosen.clamp(min=0).to(host.keys.device)[..., None].expand(-1, -1, dim)
            external = (host.keys.gather(1, gather), host.values.gather(1, gather), chosen_valid.to(host.keys.device))
        if self.dcu is not False:  # DCU: this query and its top-rho reranked rows replace the oldest centroid
            with stage("dcu"):
                dcu = torch.where(ranked_valid[:, :rho], ranked_rows[:, :rho], -1)
                if dcu.shape[1] < rho:
                    dcu = F.pad(dcu, (0, rho - dcu.shape[1]), value=-1)
                index.push(q.reshape(heads * group, dim).to(index.centroids.dtype), dcu)  # in place: clones fork it
        recall = None
        if step.measure_recall:  # over every token: resident and host
            recall = resident_and_host_recall(q, view.keys, host.keys, chosen, chosen_valid, scaling)
        moved = 0 if host.keys.device == q.device else (2 * q.numel() + heads * group) * 4  # q out, output + lse back
        recall_size = float(valid.sum(dim=1).float().mean())
        return Selection(resident, external=external, recall=recall, moved_bytes=moved,
                         extra={"recall_size": recall_size, "alpha": recall_size / (index.lists.shape[2] * top_lists)})

    @staticmethod
    def _recall(q: torch.Tensor, index: QueryIndex, retrieved: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Q2Q recall: the union of the top-C' centroids' lists per KV head, deduplicated and padded, with a
        validity mask ([H, R] each)."""
        heads, group, dim = q.shape
        centroids = index.centroids.view(heads, group, -1, dim)
        cosine = F.cosine_similarity(q[:, :, None, :].float(), centroids.float(), dim=-1).amax(dim=1)  # [H, C]
        top = cosine.topk(min(retrieved, cosine.shape[1]), dim=-1).indices
        candidates = index.lists.gather(1, top[..., None].expand(-1, -1, index.lists.shape[2])).reshape(heads, -1).long()
        ordered = candidates.sort(dim=-1).values
        fresh = torch.ones_like(ordered, dtype=torch.bool)
        fresh[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        valid = fresh & (ordered >= 0)
        width = int(valid.sum(dim=1).max())
        # pack each head's unique rows to the front (stable), then cut to the widest head
        packed = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices[:, :width]
        return ordered.gather(1, packed), valid.gather(1, packed)

    def step_traffic(self, layer, selection, step):
        """The paper's work per step: centroid cosines, the recalled keys (rerank), the retrieved and resident
        K/V (attention). Section 3.1.2's rerank model: L_recall*d + 2*rho'*d instead of 2*L_recall*d."""
        if selection is None or selection.external is None:
            return super().step_traffic(layer, None, step)
        centroids = layer.derived["index"].centroids
        heads, dim = selection.idx.shape[0], layer.head_dim
        retrieved = selection.external[0].shape[1]
        return int(centroids.numel() + heads * dim * (selection.extra["recall_size"] + 2 * retrieved)
                   + 2 * dim * sum(layer.lengths()))
