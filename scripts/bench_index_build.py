"""CTKVR Fig. 8 (and App. B.3's Table 9): index build time and top-k recall of ANN indexes against CTKVR's
query-centric index, over the keys of one layer.

    nice -n 10 python scripts/bench_index_build.py [--lengths 4096,8192,16384,32768] [--long]
        [--data model|gaussian] [--layer 2] [--k N] [--test-queries 32] [--threads 1]
        [--out docs/efficiency/index_build]

Data: `model` (default) runs the embedded SmolLM2 (`kvbench.models`, kvbench/conf/model/smollm2_135m.yaml) over Paul
Graham essays (kvbench.tasks.haystack) once, at the longest length plus the test queries, and takes layer
`--layer`'s post-RoPE keys and queries (the forward stops at that layer; its queries and keys are its own
projections and rotary embedding); a length N uses the first N keys as the index, the last C prompt queries
before N as CTKVR's centroids, and the `--test-queries` queries at positions N.. (decode-like: they come right
after the indexed prompt) as the searches. `gaussian`: i.i.d. standard normal keys and queries (no locality
between queries: a control). Past SmolLM2's 8192 positions the rotary embedding is extrapolated.

Indexes, per KV head unless said (build times are summed over the layer's KV heads, i.e. one layer's index):

- `ctkvr`: `kvbench.methods.ctkvr.build_index` over every key (C = min(2048, N/16) centroids, rho = 2.5 k), all
  heads in one call; search = CTKVR's own Q2Q recall (C' = 4, `CTKVR._recall`) and rerank (softmax over the
  recalled keys, max over the group) to k rows shared by the group;
- `ivf`: faiss `IndexIVFFlat` (inner product, nlist = round(sqrt(N)), faiss's default k-means), train + add;
- `hnsw`: faiss `IndexHNSWFlat` (inner product, M = 32, efConstruction = 40), as RetrievalAttention's
  `graph=hnsw` builds it;
- `kmeans`: faiss `Kmeans` (spherical, nlist centroids, `--kmeans-iters` iterations, SqueezedAttention's up to
  300) + assignment; search = clusters by q.centroid until the budget of keys, exact rerank;
- `roargraph`: RetrievalAttention's `graph=roar` index (`kvbench.methods.retrieval_attention.build_graph`: the
  HNSW above plus RoarGraph's edges projected from the last 2048 prompt queries' exact top-32).

Matched search budgets: CTKVR's mean number of vectors scored per query head (its C centroid cosines plus the
recalled keys it reranks) is the budget S; IVF probes the lists that make S (nlist + nprobe * N/nlist), k-means
scans clusters up to S, and HNSW / RoarGraph take the efSearch (>= k) from a grid whose scored count (faiss
`hnsw_stats.ndis`) is nearest S. Every row reports what it scored. Recall: per query head, the share of its
exact top-k keys by q.k that the index returned (CTKVR returns one set per group, by design; `recall_group`
is CTKVR's against the group's FLAT top-k, the max over the group of each head's softmax).

Timing is wall time of one build on `--threads` threads for torch and faiss alike (default 1: the machine is
shared, and it makes the comparison about the algorithms); the paper's CTKVR times are GPU times. Writes
`<out>.csv` and `<out>.png` (build time, log scale, and recall vs key length, one line per index) and prints
the table with build times relative to CTKVR.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvbench.methods.ctkvr import CTKVR, QueryIndex, build_index
from kvbench.methods.retrieval_attention import build_graph

METHODS = ("ctkvr", "ivf", "hnsw", "kmeans", "roargraph")
EF_GRID = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0)  # efSearch / k


@dataclass
class Data:
    """keys [H, L, D] and queries [H * G, L, D] (post-RoPE, fp32) of one layer; the last `test` positions are
    never indexed."""

    keys: torch.Tensor
    queries: torch.Tensor
    test: int
    source: str


def gaussian_data(n: int, heads: int = 3, group: int = 3, dim: int = 64, test_queries: int = 32, seed: int = 0) -> Data:
    gen = torch.Generator().manual_seed(seed)
    length = n + test_queries
    return Data(torch.randn(heads, length, dim, generator=gen), torch.randn(heads * group, length, dim, generator=gen),
                test_queries, "gaussian")


class _Captured(Exception):
    pass


def model_data(n: int, layer: int, test_queries: int) -> Data:
    """Layer `layer`'s post-RoPE keys and queries of the embedded SmolLM2 over `n + test_queries` essay tokens."""
    from omegaconf import OmegaConf

    from kvbench.engine.session import Session
    from kvbench.models import load_model
    from kvbench.tasks.haystack import essay_text

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "model" / "smollm2_135m.yaml")
    cfg.device, cfg.dtype = "cpu", "float32"
    lm = load_model(cfg)
    ids = lm.tokenizer(essay_text(), add_special_tokens=False)["input_ids"]
    length = n + test_queries
    ids = (ids * math.ceil(length / len(ids)))[:length]
    attn = lm.model.model.layers[layer].self_attn
    module = sys.modules[type(attn).__module__]
    got = {}

    def grab(_module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        shape = (*hidden.shape[:-1], -1, attn.head_dim)
        q, k = attn.q_proj(hidden).view(shape), attn.k_proj(hidden).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3's QK-norm
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = kwargs["position_embeddings"]
        q, k = module.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        got["q"], got["k"] = q[0].float().clone(), k[0].float().clone()
        raise _Captured

    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        Session(lm, None, None).forward(ids)
    except _Captured:
        pass
    finally:
        handle.remove()
    return Data(got["k"], got["q"], test_queries, f"SmolLM2-135M layer {layer}, essays")


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, 1e3 * (time.perf_counter() - start)


def _recall(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean over queries of |found ∩ exact| / k; found [Q, k'] (-1 ignored), exact [Q, k]."""
    return float(np.mean([len(set(f[f >= 0].tolist()) & set(e.tolist())) / len(e) for f, e in zip(found, exact)]))


def scaled_k(n: int) -> int:
    """The default top-k: N/32 up to CTKVR's 1024 (4K keys: 128; 32K and longer: 1024)."""
    return min(1024, max(64, n // 32))


def measure(data: Data, n: int | None = None, k: int | None = None, centroids: int | None = None, seed: int = 0,
            kmeans_iters: int = 300, retrieved_centroids: int = 4) -> list[dict]:
    """One key length: every index's build time, recall and vectors scored per query head."""
    import faiss

    n = n or data.keys.shape[1] - data.test
    heads, dim = data.keys.shape[0], data.keys.shape[2]
    group = data.queries.shape[0] // heads
    k = min(k or scaled_k(n), n // 4)
    c = centroids or min(2048, max(1, n // 16))
    keys = data.keys[:, :n].contiguous()
    prompt_q = data.queries[:, :n]
    test_q = data.queries[:, n:n + data.test].reshape(heads, group, data.test, dim)
    exact = torch.einsum("hgtd,hnd->hgtn", test_q, keys).topk(k, dim=-1).indices.numpy()  # [H, G, T, k]
    rows: list[dict] = []

    # CTKVR: Algorithm 1 over every key, then Q2Q recall + rerank per test query
    positions = torch.arange(n).expand(heads, n)
    chunk = max(1, 2**26 // (heads * group * n))
    scaling = dim ** -0.5
    lists, ms = _timed(lambda: build_index(prompt_q[:, n - c:], torch.arange(n - c, n), keys, positions,
                                           torch.ones(heads, n, dtype=torch.bool), int(2.5 * k), scaling, chunk))
    index = QueryIndex(prompt_q[:, n - c:].clone(), lists)
    hits, group_hits, scored = [], [], []
    for t in range(data.test):
        q = test_q[:, :, t]
        recalled, valid = CTKVR._recall(q, index, retrieved_centroids)
        cand = keys.gather(1, recalled[..., None].expand(-1, -1, dim))
        logits = torch.einsum("hgd,hrd->hgr", q, cand) * scaling
        score = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), -1).amax(1)
        chosen = recalled.gather(1, score.topk(min(k, recalled.shape[1]), dim=-1).indices)
        flat = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys) * scaling, -1).amax(1).topk(k, -1).indices
        for h in range(heads):
            group_hits.append(_recall(chosen[h:h + 1].numpy(), flat[h:h + 1].numpy()))
            hits.append(_recall(chosen[h].expand(group, -1).numpy(), exact[h, :, t]))
        scored.append(c + float(valid.sum(dim=1).float().mean()))
    budget = float(np.mean(scored))
    rows.append({"method": "ctkvr", "build_ms": ms, "recall": float(np.mean(hits)), "recall_group": float(np.mean(group_hits)),
                 "scored_keys": budget, "params": f"C={c} C'={retrieved_centroids} rho={int(2.5 * k)}"})

    per_head = [keys[h].numpy() for h in range(heads)]
    queries_of = [test_q[h].reshape(-1, dim).numpy() for h in range(heads)]  # [G * T, D], query head g first
    exact_of = [exact[h].reshape(-1, k) for h in range(heads)]
    nlist = max(1, round(math.sqrt(n)))

    # IVF-Flat (inner product): faiss's own k-means training, then probes for the budget
    def ivf():
        built = []
        for x in per_head:
            quantizer = faiss.IndexFlatIP(dim)
            index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.cp.seed = seed
            index.train(x)
            index.add(x)
            built.append((index, quantizer))
        return built
    built, ms = _timed(ivf)
    nprobe = int(min(nlist, max(1, round((budget - nlist) / (n / nlist)))))
    found = []
    for (index, _), q in zip(built, queries_of):
        index.nprobe = nprobe
        found.append(index.search(q, k)[1])
    sizes = [faiss.extract_index_ivf(index).invlists.list_size(i) for index, _ in built for i in range(nlist)]
    rows.append({"method": "ivf", "build_ms": ms, "recall": np.mean([_recall(f, e) for f, e in zip(found, exact_of)]),
                 "scored_keys": nlist + nprobe * float(np.mean(sizes)), "params": f"nlist={nlist} nprobe={nprobe}"})

    # HNSW and RoarGraph (RetrievalAttention's two graphs)
    train = [prompt_q[h * group:(h + 1) * group, -2048:].reshape(-1, dim).numpy() for h in range(heads)]
    for name, make in (("hnsw", lambda h: build_graph(per_head[h])),
                       ("roargraph", lambda h: build_graph(per_head[h], train[h]))):
        graphs, ms = _timed(lambda make=make: [make(h) for h in range(heads)])
        best = None
        for factor in EF_GRID:  # scored keys grow with efSearch: stop past the budget
            params = faiss.SearchParametersHNSW()
            params.efSearch = int(factor * k)
            faiss.cvar.hnsw_stats.reset()
            found = [graph.search(q, k, params=params)[1] for graph, q in zip(graphs, queries_of)]
            ndis = faiss.cvar.hnsw_stats.ndis / (heads * group * data.test)
            if best is None or abs(ndis - budget) < abs(best[0] - budget):
                best = (ndis, found, params.efSearch)
            if ndis > budget:
                break
        ndis, found, ef = best
        rows.append({"method": name, "build_ms": ms, "recall": np.mean([_recall(f, e) for f, e in zip(found, exact_of)]),
                     "scored_keys": ndis, "params": f"M=32 efC=40 ef={ef}"})

    # KMeans (SqueezedAttention's clustering): spherical, then clusters by q.centroid up to the budget
    def kmeans():
        out = []
        for x in per_head:
            km = faiss.Kmeans(dim, nlist, niter=kmeans_iters, seed=seed, spherical=True)
            km.train(x)
            out.append((km.centroids.copy(), km.index.search(x, 1)[1][:, 0]))
        return out
    clusters, ms = _timed(kmeans)
    found, scanned = [], []
    for (cents, assign), x, q in zip(clusters, per_head, queries_of):
        order = np.argsort(-(q @ cents.T), axis=1, kind="stable")
        sizes = np.bincount(assign, minlength=nlist)
        result = np.full((len(q), k), -1)
        for i in range(len(q)):
            take = order[i, : max(1, int(np.searchsorted(np.cumsum(sizes[order[i]]), budget - nlist)) + 1)]
            members = np.nonzero(np.isin(assign, take))[0]
            best = members[np.argsort(-(x[members] @ q[i]), kind="stable")[:k]]
            result[i, :len(best)] = best
            scanned.append(nlist + len(members))
        found.append(result)
    rows.append({"method": "kmeans", "build_ms": ms, "recall": np.mean([_recall(f, e) for f, e in zip(found, exact_of)]),
                 "scored_keys": float(np.mean(scanned)), "params": f"clusters={nlist} iters={kmeans_iters}"})

    base = rows[0]["build_ms"]
    for row in rows:
        row.update(keys=n, k=k, build_ratio=row["build_ms"] / base, recall=float(row["recall"]))
        row.setdefault("recall_group", "")
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method in METHODS:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["keys"])
        xs = [r["keys"] for r in mine]
        line, = left.plot(xs, [r["build_ms"] for r in mine], marker="o", label=method)
        right.plot(xs, [r["recall"] for r in mine], marker="o", label=method, color=line.get_color())
        if method == "ctkvr":  # its own target: the group's FLAT top-k (one shared set per KV head)
            right.plot(xs, [r["recall_group"] for r in mine], marker="o", linestyle="--", color=line.get_color(),
                       label="ctkvr vs group FLAT top-k")
    for ax, label in ((left, "index build time (ms, one layer)"), (right, "top-k recall per query head")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("key length")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    right.set_ylim(0, 1.02)
    left.legend()
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--long", action="store_true", help="add 65536 and 131072 keys")
    parser.add_argument("--data", choices=("model", "gaussian"), default="model")
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--k", type=int, default=None, help="top-k (default: N/32, at most 1024: CTKVR's budget)")
    parser.add_argument("--test-queries", type=int, default=32)
    parser.add_argument("--kmeans-iters", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/efficiency/index_build")
    args = parser.parse_args(argv)
    import faiss

    lengths = [int(x) for x in args.lengths.split(",")] + ([65536, 131072] if args.long else [])
    longest = max(lengths)
    data = (model_data(longest, args.layer, args.test_queries) if args.data == "model"  # untimed: every thread
            else gaussian_data(longest, test_queries=args.test_queries, seed=args.seed))
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    measure(gaussian_data(2048, test_queries=2), k=64, kmeans_iters=5)  # warm-up: first-call overheads out of the timings
    rows = []
    print(f"data: {data.source}; keys [H={data.keys.shape[0]}, D={data.keys.shape[2]}], {data.queries.shape[0]} "
          f"query heads, {args.test_queries} test queries; {args.threads} thread(s)")
    print(f"{'keys':>7} {'method':>10} {'build ms':>10} {'x ctkvr':>8} {'recall':>7} {'scored':>8}  params")
    for n in lengths:
        for row in measure(data, n, args.k, seed=args.seed, kmeans_iters=args.kmeans_iters):
            rows.append(row)
            print(f"{row['keys']:>7} {row['method']:>10} {row['build_ms']:>10.1f} {row['build_ratio']:>8.1f} "
                  f"{row['recall']:>7.3f} {row['scored_keys']:>8.0f}  {row['params']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = ["keys", "method", "build_ms", "build_ratio", "recall", "recall_group", "scored_keys", "k", "params"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    k = f"k={args.k}" if args.k else "k=N/32 (<=1024)"
    plot(rows, out.with_suffix(".png"), f"Index build (CTKVR Fig. 8 layout): {data.source}, {k}")
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
