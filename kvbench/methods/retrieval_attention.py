"""RetrievalAttention (Liu, Chen, Lu et al. 2024, arXiv 2409.10516; github.com/microsoft/RetrievalAttention):
decode-time attention over the keys an approximate-nearest-neighbour (ANN) index finds in host memory.

When the prompt's prefill ends (dense and exact, as in the paper), per layer:

- a static set stays resident on the device: the first `n_init` and the last `n_local` prompt tokens (the
  StreamingLLM pattern the paper keeps on the GPU); every generated token is appended there;
- the rest moves to host memory (a `HostSegment`) and one graph index per KV head is built over its keys,
  searched by maximum inner product (the attention logit is q.k / sqrt(d)).

Every decode step, per layer: each query head searches its KV head's index with its own query for its top-k
keys (k = the budget; CTKVR's Table 8 runs k = 1024) with a beam of `ef_search`; attention over those host
rows and over the resident set merge exactly by log-sum-exp (`Selection.external`), as the paper's CPU/GPU
co-execution merges its two partial attentions. The resident set is attended on top of k (CTKVR's budget
convention: rho' counts the retrieved keys only, conf/experiment/ctkvr_table8.yaml).

**The index.** The paper's RoarGraph (Chen et al., VLDB 2024) has no maintained Python package; kvbench uses
faiss's HNSW (`IndexHNSWFlat`, `METRIC_INNER_PRODUCT`), with two graphs:

- `graph=roar` (default), the query-aware approximation. RoarGraph links each prefill query to its exact
  top-N_q keys and projects that bipartite graph onto the keys (keys retrieved by one query become
  neighbours), so a search with a query, which is out of the keys' distribution, walks along edges the
  query distribution drew. Here: an HNSW over the keys, whose base-layer lists are rewritten so that every
  key that is some prefill query's nearest key (its pivot) lists first the other keys of those queries'
  exact top-`query_knn` (`faiss.knn`; by rank, then query order, up to M of the 2M slots); the HNSW's own neighbours fill
  the remaining slots and its upper layers stay, which keeps the graph navigable (RoarGraph's connectivity
  enhancement does this with extra edges). The training queries are the last `index_queries` prompt
  queries of the group's G query heads. Not reproduced: RoarGraph's occlusion pruning of the projected
  lists and its search from a medoid (the HNSW's hierarchy gives the entry point).
- `graph=hnsw`: the plain key-only HNSW, the off-the-shelf index the paper shows must scan far more keys to
  reach the same recall for attention queries.

**GQA.** `granularity=head` (default): every query head searches with its own query and attends to its own
k rows (the paper's per-head attention); the group's union is gathered once and each head's logits of the
other heads' rows are -inf (`Selection.external`'s log-weights), so a group reads up to G*k distinct rows,
as Exact-TopK's `granularity=head` (`decode_attended_tokens_per_head` counts each head's own k).
`granularity=group_max` (conf/method/retrieval_attention_group.yaml): the union of the G searches is reranked by
the max over the group of each head's softmax over it, one shared top-k per KV head: k rows per KV group, CTKVR's
count of rho' and its aggregation (its FLAT's), so RetrievalAttention and CTKVR do equal work per KV group. Every
record says which: `budget_plan.granularity`, `k_per_query_head`, `k_per_kv_group` (k with `group_max`; null with
`head`, where it varies) and, measured, `decode_method_stats.retrieved_rows` (distinct host rows a KV group read
per step).

Defaults, and which of them are assumptions. n_init 128 and n_local 512 (a 640-token static pattern) and
`ef_search` null (= k, the smallest beam that returns k rows) are NOT verified against the paper: its text was not
at hand, and its repository's history holds no RetrievalAttention code (github.com/microsoft/RetrievalAttention:
template files of 2024-09-26, then RetroInfer from 2025-05-15 on, whose configs keep a static pattern of 4 + 64
and search clusters, not a graph; no branch or pull-request ref holds more). CTKVR's Table 8 states only the
model and rho' = 1024. So every record names them (`budget_plan.unverified`: n_init, n_local, ef_search) and
docs/baselines.md says so; a run that knows the paper's values sets `method.n_init`, `method.n_local`,
`method.ef_search`. M = 32 and efConstruction = 40 are faiss's HNSW defaults; query_knn 32 and index_queries 2048
RoarGraph's N_q and its training queries (RetrievalAttention states neither here).

**Cost model** (`step_traffic`, elements per step): the keys the graph search scored (faiss's
`hnsw_stats.ndis`, every query head's search counted; the adjacency lists it read are not), the retrieved
K/V rows (the group's union), the group's candidate keys once more when `group_max` reranks, and the
resident K/V. Selection.extra: `visited_keys` and `retrieved_rows` per KV head and step, with
`step.measure_recall` also `ann_recall`, the share of each query head's exact top-k host rows (by q.k) its
search returned; the record's `topk_recall` is the attention-mass recall over every token.

Other departures: a k covering every host row attends to all of them without a search (exact); later turns'
tokens stay resident and are not indexed (the paper indexes the prompt once); faiss keeps its own float32
copy of the host keys, counted in the index's host bytes (its graph edges are the Table 1 auxiliary
elements). Deterministic: faiss builds and searches on one OpenMP thread (HNSW levels come from faiss's
fixed seed), restored afterwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvbench.core.checks import is_int
from kvbench.core.contract import Selection
from kvbench.methods.base import OffloadMethod, register_method
from kvbench.methods.common.derived import FixedState
from kvbench.methods.common.placement import HostSegment, mass_recall

# parameters whose paper values kvbench could not check (module docstring): every record names them
UNVERIFIED = ["n_init", "n_local", "ef_search"]


def _faiss():
    import faiss  # imported on first use: importing kvbench must not load faiss's OpenMP and BLAS

    return faiss


@contextlib.contextmanager
def one_thread():
    """faiss on one OpenMP thread (a deterministic insertion order), the previous count restored."""
    faiss = _faiss()
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield faiss
    finally:
        faiss.omp_set_num_threads(before)


def build_graph(keys: np.ndarray, queries: np.ndarray | None = None, m: int = 32, ef_construction: int = 40,
                query_knn: int = 32):
    """An HNSW (inner product) over `keys` [n, D] float32; with `queries` [q, D] its base layer is rewritten
    with RoarGraph's query-projected edges first (module docstring). Returns the faiss index."""
    with one_thread() as faiss:
        index = faiss.IndexHNSWFlat(keys.shape[1], m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
        index.add(np.ascontiguousarray(keys, dtype=np.float32))
    if queries is not None and len(queries) and len(keys) > 1:
        _project(index, np.ascontiguousarray(keys, dtype=np.float32), np.ascontiguousarray(queries, dtype=np.float32),
                 min(query_knn, len(keys)))
    return index


def _project(index, keys: np.ndarray, queries: np.ndarray, knn: int) -> None:
    """RoarGraph's projection onto the base layer: each pivot (a query's nearest key) lists the rest of its
    queries' exact top-`knn` keys first (by rank, then query order; up to half the slots), then its own HNSW
    neighbours, duplicates and itself dropped."""
    with one_thread() as faiss:
        top = faiss.knn(queries, keys, knn, metric=faiss.METRIC_INNER_PRODUCT)[1]  # [q, knn], exact, by rank
    hnsw = index.hnsw
    width, n = hnsw.nb_neighbors(0), len(keys)
    neighbors = faiss.vector_to_array(hnsw.neighbors)
    offsets = faiss.vector_to_array(hnsw.offsets).astype(np.int64)
    # every (pivot, candidate) pair in the order (pivot, rank, query); the first of each pair kept
    ranks = np.broadcast_to(np.arange(1, knn), (len(top), knn - 1))
    order = np.lexsort((np.broadcast_to(np.arange(len(top))[:, None], ranks.shape).ravel(), ranks.ravel(),
                        np.repeat(top[:, 0], knn - 1)))
    pivot, cand = np.repeat(top[:, 0], knn - 1)[order], top[:, 1:].ravel()[order]
    first = np.sort(np.unique(pivot * n + cand, return_index=True)[1])
    pivot, cand = pivot[first], cand[first]
    pivots, starts, counts = np.unique(pivot, return_index=True, return_counts=True)
    slot = np.arange(len(pivot)) - np.repeat(starts, counts)  # rank of the candidate within its pivot
    quota = width // 2
    projected = np.full((len(pivots), quota), -1, dtype=neighbors.dtype)
    keep = slot < quota
    projected[np.searchsorted(pivots, pivot[keep]), slot[keep]] = cand[keep]
    base = offsets[pivots][:, None] + np.arange(width)
    merged = np.concatenate([projected, neighbors[base]], axis=1)
    # drop repeats (keep the first), the pivot itself and padding; pack what is left to the front
    by_value = np.argsort(merged, axis=1, kind="stable")
    sorted_values = np.take_along_axis(merged, by_value, axis=1)
    repeat = np.zeros_like(merged, dtype=bool)
    np.put_along_axis(repeat, by_value[:, 1:], sorted_values[:, 1:] == sorted_values[:, :-1], axis=1)
    merged[repeat | (merged == pivots[:, None])] = -1
    packed = np.take_along_axis(merged, np.argsort(merged < 0, axis=1, kind="stable"), axis=1)[:, :width]
    neighbors[base] = packed
    faiss.copy_array_to_vector(neighbors, hnsw.neighbors)


@dataclass(frozen=True)
class GraphIndex(FixedState):
    """One faiss graph per KV head over its host rows (row i of the index = host row i). Searching does not
    change it, so forks share it."""

    graphs: tuple
    rows: int
    last_position: int  # the newest logical position indexed: a rollback past it drops the index
    on_host = True

    def search(self, q: torch.Tensor, k: int, ef: int) -> tuple[torch.Tensor, int]:
        """Each query head's top-`k` rows `[H, G, k]` (int64, -1 where the search found fewer) and the number
        of keys the searches scored (faiss's ndis)."""
        with one_thread() as faiss:
            params = faiss.SearchParametersHNSW()
            params.efSearch = max(ef, k)
            faiss.cvar.hnsw_stats.reset()
            found = [graph.search(np.ascontiguousarray(q[h].float().numpy()), k, params=params)[1]
                     for h, graph in enumerate(self.graphs)]
            visited = int(faiss.cvar.hnsw_stats.ndis)
        return torch.from_numpy(np.stack(found)).long(), visited

    def truncate(self, layer) -> "GraphIndex | None":
        return self if layer.seen > self.last_position else None

    def nbytes(self) -> int:  # faiss's float32 copy of the keys, the graph's edge slots, offsets and levels
        return sum(graph.ntotal * graph.d * 4 + graph.hnsw.neighbors.size() * 4 + graph.hnsw.offsets.size() * 8
                   + graph.hnsw.levels.size() * 4 for graph in self.graphs)

    @property
    def paper_elements(self) -> int:  # the graphs' edge slots (the float32 key copy is an artifact of faiss)
        return sum(int(graph.hnsw.neighbors.size()) for graph in self.graphs)


@register_method
@dataclass
class RetrievalAttention(OffloadMethod):
    name = "retrieval_attention"
    host_work = "RetrievalAttention searches its faiss graph index on the CPU at every decode step"
    steps_through_chunks: ClassVar[bool] = False  # a later chunk attends densely (host rows included)
    n_init: int = 128
    n_local: int = 512
    graph: str = "roar"  # roar: HNSW + RoarGraph's query-projected edges; hnsw: keys only
    granularity: str = "head"  # head: each query head its own top-k; group_max: one shared top-k per KV head
    hnsw_m: int = 32
    ef_construction: int = 40
    ef_search: int | None = None  # null: the budget
    query_knn: int = 32
    index_queries: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_init", "n_local"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a number of tokens >= 0, got {value!r}")
        for name in ("hnsw_m", "ef_construction", "query_knn", "index_queries"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ef_search is not None and (not is_int(self.ef_search) or self.ef_search < 1):
            raise ValueError(f"ef_search must be a positive integer or null (the budget), got {self.ef_search!r}")
        if self.graph not in ("roar", "hnsw"):
            raise ValueError(f"graph must be roar or hnsw, not {self.graph!r}")
        if self.granularity not in ("head", "group_max"):
            raise ValueError(f"granularity must be head or group_max, not {self.granularity!r}")

    @property
    def obs_window(self) -> int:
        return self.index_queries if self.graph == "roar" else 0

    # the "eviction" event (`OffloadMethod.schedule`) moves the prompt's middle to host memory and indexes it
    def plan_derived(self, budget, prompt):
        return {"k": budget, "ef_search": self.ef_search or budget, "n_init": self.n_init, "n_local": self.n_local,
                "granularity": self.granularity, "k_per_query_head": budget,
                "k_per_kv_group": budget if self.granularity == "group_max" else None,  # head: up to G * k, measured
                "unverified": list(UNVERIFIED)}

    # -- prefill end: offload the middle, index it ----------------------------------------------------------
    def keep(self, layer, budget, step):
        view = layer.head_view()
        first_local = layer.seen - self.n_local
        moving = (view.positions >= self.n_init) & (view.positions < first_local)
        if layer.derived.get("host") is not None or not bool(moving.any()):
            return None  # already offloaded, or the prompt is all initial and local tokens
        rows = torch.nonzero(moving[0]).flatten()
        host = HostSegment.of(view.keys, view.values, view.positions, rows)
        heads = host.keys.shape[0]
        queries = None
        if self.graph == "roar" and layer.queries is not None:
            window = layer.queries[:, -self.index_queries:].float().cpu()
            queries = window.reshape(heads, -1, window.shape[-1])  # query head h*G+g trains KV head h
        graphs = tuple(build_graph(host.keys[h].float().numpy(), None if queries is None else queries[h].numpy(),
                                   self.hnsw_m, self.ef_construction, self.query_knn) for h in range(heads))
        layer.derived["host"] = host
        layer.derived["index"] = GraphIndex(graphs, int(rows.numel()), int(host.positions.max()))
        return [torch.nonzero(~moving[0]).flatten()] * layer.num_heads

    # -- decode ---------------------------------------------------------------------------------------------
    def select(self, layer, q, view, step, scaling):
        host, index = layer.derived.get("host"), layer.derived.get("index")
        if host is None:
            return None
        if index is None:
            raise RuntimeError("retrieval_attention: a rollback reached the indexed host rows; the index is gone")
        heads, group, _ = q.shape
        n_res = view.keys.shape[1]
        rows, valid, own, extra = self._retrieve(q, host, index, step, scaling)
        head = torch.arange(heads, device=host.keys.device)[:, None]
        rows_there = rows.to(host.keys.device)
        keys, values = host.keys[head, rows_there], host.values[head, rows_there]  # [H, m, D]
        weights = torch.zeros(own.shape, dtype=torch.float32).masked_fill_(~own, float("-inf"))
        external = (keys, values, valid.to(keys.device), weights.to(keys.device))
        recall = self._recall(q, view, host, rows, own, extra, scaling) if step.measure_recall else None
        moved = 0 if host.keys.device == q.device else (2 * q.numel() + heads * group) * 4  # q out, output + lse back
        resident = torch.arange(n_res, device=q.device).expand(heads, group, n_res)
        return Selection(resident, external=external, recall=recall, moved_bytes=moved, extra=extra)

    def _retrieve(self, q, host, index, step, scaling):
        """The host rows the step attends: `rows` [H, m] (the group's union, padded), `valid` [H, m], `own`
        [H, G, m] (which query head attends which row), and the step's numbers."""
        heads, group, _ = q.shape
        k = min(step.plan.derived["k"], index.rows)
        q_host = q.detach().to("cpu")
        if k >= index.rows:  # every host row: nothing to search
            found, visited = torch.arange(index.rows).expand(heads, group, -1), 0
        else:
            found, visited = index.search(q_host, k, step.plan.derived["ef_search"])
        rows, valid, own = _union(found)
        extra = {"visited_keys": visited / heads}
        if self.granularity == "group_max":
            extra["candidate_rows"] = float(valid.sum()) / heads
            cand = host.keys[torch.arange(heads)[:, None], rows.to(host.keys.device)].cpu()
            logits = torch.einsum("hgd,hmd->hgm", q_host.float(), cand.float()) * scaling
            score = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), -1).amax(1)
            take = score.topk(min(k, rows.shape[1]), dim=-1).indices.sort(dim=-1).values
            rows, valid = rows.gather(1, take), valid.gather(1, take)
            own = valid[:, None, :].expand(-1, group, -1)
        extra["retrieved_rows"] = float(valid.sum()) / heads
        return rows, valid, own, extra

    @staticmethod
    def _recall(q, view, host, rows, own, extra, scaling) -> float:
        """Attention-mass recall over every token (resident and host), and `ann_recall` into `extra`."""
        everything = torch.cat([view.keys, host.keys.to(view.keys.device)], dim=1)
        logits = torch.einsum("hgd,hnd->hgn", q.float(), everything.float()) * scaling
        n_res = view.keys.shape[1]
        if view.valid is not None:
            logits[..., :n_res] = logits[..., :n_res].masked_fill(~view.valid[:, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        rows = rows.to(q.device)
        host_mass = probs[..., n_res:].gather(-1, rows[:, None, :].expand(-1, q.shape[1], -1))
        own = own.to(q.device)
        k = int(own.sum(-1).max())
        chosen = probs[..., :n_res].sum(-1) + (host_mass * own).sum(-1)
        exact = logits[..., n_res:].topk(k, dim=-1).indices  # each query head's exact top-k host rows
        hits = (exact[..., :, None] == torch.where(own, rows[:, None, :], -1)[..., None, :]).any(-1)
        extra["ann_recall"] = float(hits.float().mean())
        return mass_recall(probs, chosen, n_res + k)

    def step_traffic(self, layer, selection, step):
        """Keys the graph search scored, the group's candidate keys again when `group_max` reranks, the
        retrieved K/V rows, the resident K/V."""
        if selection is None or selection.external is None:
            return super().step_traffic(layer, None, step)
        heads, dim, extra = selection.idx.shape[0], layer.head_dim, selection.extra
        scored = extra["visited_keys"] + extra.get("candidate_rows", 0.0)
        return int(round(heads * dim * (scored + 2 * extra["retrieved_rows"])) + 2 * dim * sum(layer.lengths()))


def _union(found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per KV head the union of its query heads' rows `found` [H, G, k] (-1: none): rows [H, m] sorted and
    padded with 0, valid [H, m], own [H, G, m]."""
    heads, group, _ = found.shape
    span = int(found.max()) + 2
    hit = found >= 0
    shifted = torch.where(hit, found + torch.arange(heads)[:, None, None] * span, 0)  # one sorted space, by head
    every = torch.unique(shifted[hit])
    head = every // span
    counts = torch.bincount(head, minlength=heads)
    width = max(1, int(counts.max()))
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(every)) - starts[head]
    rows = torch.zeros(heads, width, dtype=torch.long)
    valid = torch.zeros(heads, width, dtype=torch.bool)
    rows[head, slot], valid[head, slot] = every % span, True
    where = torch.searchsorted(every, shifted) - starts[:, None, None]
    own = torch.zeros(heads, group, width + 1, dtype=torch.bool)  # the last column takes the -1 entries
    own.scatter_(2, torch.where(hit, where, width), True)
    return rows, valid, own[..., :width]
