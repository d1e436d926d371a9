"""Empirical claims of the CTKVR and OmniKV papers, measured on a real model's attention (specs: ctkvr.md §7,
omnikv.md §7).

    python scripts/check_claims.py                                  # embedded SmolLM2, RULER niah_single_2, 2K
    python scripts/check_claims.py --task twostage_retr --samples 3

One dense prefill per sample through the engine; every layer keeps its last `--window` post-RoPE queries (the
cache's query window) and its keys, from which the attention rows are recomputed exactly (fp32, causal).

- CTKVR E1: mean cosine similarity of post-RoPE queries at distance d, averaged over layers, heads and
  positions (the paper: > 0.8 within 1K tokens in most RULER tasks).
- CTKVR E2: for query pairs, Spearman correlation between their cosine and the overlap of their top-k keys
  (k = 5% of the prompt); the paper's Fig. 2b shows a positive trend.
- OmniKV P1: the attention mass that layer j's last-query attention (head mean) puts on layer i's top-k set,
  S(i -> j), for j in (i, i + 8], against a random set of k tokens and the oracle S(j -> j).
- OmniKV P3: the share of prompt tokens holding 90% of the last query's attention, per layer (sparse
  layers, with the first layers less sparse, justify OmniKV's dense prefix).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from omegaconf import OmegaConf

from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.models import load_model

CONF = Path(__file__).resolve().parents[1] / "conf"


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = torch.tensor(a).argsort().argsort().float(), torch.tensor(b).argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def attention_rows(layer, rows: slice) -> torch.Tensor:
    """Causal softmax rows of the kept queries `rows` over the layer's keys, per query head: [H_q, r, L]."""
    keys = layer.head_view().keys.float()  # [H, L, D]
    q = layer.queries[:, rows].float()  # [H_q, r, D]
    positions = layer.query_positions[rows]
    heads, length = keys.shape[0], keys.shape[1]
    group = q.shape[0] // heads
    logits = torch.einsum("hgrd,hld->hgrl", q.view(heads, group, -1, q.shape[-1]), keys) * layer.scaling
    future = torch.arange(length)[None, None, None, :] > positions[None, None, :, None]
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1).flatten(0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--task", default="ruler_niah_single_2")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--window", type=int, default=1024, help="queries kept per layer")
    args = parser.parse_args()

    cfg = OmegaConf.load(CONF / "model" / f"{args.model}.yaml")
    lm = load_model(cfg)
    task_cfg = OmegaConf.load(CONF / "task" / f"{args.task}.yaml")
    task_cfg.num_samples = args.samples
    if "seq_len" in task_cfg:
        task_cfg.seq_len = args.length
    from hydra.utils import instantiate

    task = instantiate(task_cfg, _convert_="all")
    task.max_positions = lm.max_positions
    builder = PromptBuilder(lm.tokenizer)
    samples = task.samples(builder.measure, seed=42)
    distances = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    cosines = {d: [] for d in distances}
    pair_cos, pair_overlap = [], []
    similarity: dict[tuple[int, int], list[float]] = {}
    random_mass: dict[int, list[float]] = {}
    sparsity: dict[int, list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    for sample in samples:
        ids = sum(builder.first_turn(sample), [])
        session = Session(lm, build_method("full"), None)
        session.query_window = min(args.window, len(ids))
        session.prefill(ids, compress=False)
        layers = session.cache.layers
        n = len(ids)
        k = max(1, round(0.05 * n))
        last = []
        with torch.no_grad():
            for layer in layers:
                q = torch.nn.functional.normalize(layer.queries.float(), dim=-1)  # [H_q, w, D]
                w = q.shape[1]
                for d in distances:
                    if d < w:
                        cosines[d].append(float((q[:, d:] * q[:, :-d]).sum(-1).mean()))
                rows = attention_rows(layer, slice(w - 64, w, 8))  # 8 queries from the end, every 8th
                tops = rows.topk(k, dim=-1).indices
                for a in range(rows.shape[1]):
                    for b in range(a + 1, rows.shape[1]):
                        for h in range(0, rows.shape[0], 3):
                            overlap = len(set(tops[h, a].tolist()) & set(tops[h, b].tolist())) / k
                            pair_cos.append(float((q[h, w - 64 + 8 * a] * q[h, w - 64 + 8 * b]).sum()))
                            pair_overlap.append(overlap)
                row = attention_rows(layer, slice(w - 1, w))[:, 0].mean(0)  # head-mean last-query attention
                last.append(row)
                mass = row.sort(descending=True).values.cumsum(0)
                sparsity.setdefault(layer.layer_idx, []).append(float((mass < 0.9).sum() + 1) / n)
        for i in range(len(layers)):
            top_i = last[i].topk(k).indices
            random_set = torch.randperm(n, generator=gen)[:k]
            for j in range(i + 1, min(len(layers), i + 9)):
                similarity.setdefault((i, j), []).append(float(last[j][top_i].sum() / last[j].topk(k).values.sum()))
                random_mass.setdefault(i, []).append(float(last[j][random_set].sum() / last[j].topk(k).values.sum()))
    print(f"{lm.name}, {args.task} at {args.length} tokens, {len(samples)} samples\n")
    print("CTKVR E1: mean cosine of post-RoPE queries at distance d")
    print("  " + "  ".join(f"d={d}: {statistics.mean(v):.3f}" for d, v in cosines.items() if v))
    print(f"CTKVR E2: Spearman(query cosine, top-5% key overlap) = {spearman(pair_cos, pair_overlap):.3f} "
          f"over {len(pair_cos)} pairs")
    print("\nOmniKV P1: S(i -> j) / oracle S(j -> j), mean over j in (i, i+8]; random set of the same size")
    for i in range(len(last) - 1):
        sims = [statistics.mean(v) for (a, b), v in similarity.items() if a == i]
        print(f"  layer {i:2d}: {statistics.mean(sims):.3f}   random {statistics.mean(random_mass[i]):.3f}")
    print("\nOmniKV P3: share of prompt tokens holding 90% of the last query's attention (head mean), per layer")
    print("  " + "  ".join(f"{i}: {statistics.mean(v):.3f}" for i, v in sorted(sparsity.items())))


if __name__ == "__main__":
    main()
