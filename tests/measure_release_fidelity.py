"""The measured effects of docs/fidelity.md's Quest, OmniKV, Ada-KV and HSA sections, at the shapes of issue 62's
comparison (32 query heads over 8 KV heads, head_dim 128, 2K-8K tokens): each release reference of
tests/test_release_fidelity.py beside kvbench's code on the same random tensors.

    .venv/bin/python tests/measure_release_fidelity.py     # about a minute on 2 CPU cores

It lives beside the references it runs (tests/test_release_fidelity.py), not in scripts/: a measurement of the
test suite's own references, run from the tests folder (Python puts a script's folder on its path).
"""

from __future__ import annotations

import math

import test_release_fidelity as refs  # the release references
import torch
import torch.nn.functional as F

from kvbench.kernels.page_summary import page_scores
from kvbench.methods.adakv import allocate, release_window_scores
from kvbench.methods.common.pages import PageSummary, top_page_tokens
from kvbench.methods.hsa import hsa_parameters, hsa_select
from kvbench.methods.omnikv import _window_score

Q_HEADS, KV_HEADS, DIM = 32, 8, 128
GROUP = Q_HEADS // KV_HEADS
refs.Q_HEADS, refs.KV_HEADS, refs.GROUP = Q_HEADS, KV_HEADS, GROUP  # the references read the shapes from there


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b)


def tensors(seed: int, length: int, scale: float):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(Q_HEADS, length, DIM, generator=gen) * scale,
            torch.randn(KV_HEADS, length, DIM, generator=gen) * scale,
            torch.randn(KV_HEADS, length, DIM, generator=gen))


def omnikv_before(queries, keys, prompt, positions, k, selector):
    """kvbench's uniform/exp before issue 62: the softmax over the whole prompt, the window's prompt tokens set
    to -inf after it and kept, the window's scores summed at once."""
    heads, width, dim = queries.shape
    grouped = queries.reshape(KV_HEADS, heads // KV_HEADS * width, dim)
    logits = torch.einsum("hqd,hnd->hqn", grouped, keys) * dim ** -0.5
    best = torch.softmax(logits, -1).view(heads, width, -1).amax(0)
    alpha = torch.pow(2.0, torch.arange(width, dtype=torch.float32) - (width - 1)) if selector == "exp" else 1.0
    score = (alpha * best.T).T.sum(0) if selector == "exp" else best.sum(0)
    forced = positions[positions < prompt]
    score[forced] = float("-inf")
    top = score.topk(max(0, min(k - forced.numel(), prompt - forced.numel()))).indices
    return torch.cat([top, forced]).sort().values


def omnikv_kvbench(window, keys, prompt, step, k, selector, dtype):
    """kvbench's `OmniKV._choose` on one window (its arithmetic in `dtype`)."""
    if selector == "last":
        query = window[:, -1].view(KV_HEADS, GROUP, DIM).to(dtype)
        logits = torch.einsum("hgd,hnd->hgn", query, keys[:, :prompt].to(dtype))
        return (logits / (1 / DIM ** -0.5)).flatten(0, 1).amax(0).topk(k).indices.sort().values
    in_window = max(0, window.shape[1] - step)
    candidates = prompt - in_window
    score = _window_score(window, keys[:, :candidates], KV_HEADS, DIM ** -0.5, selector, dtype)
    top = score.topk(min(max(1, k - in_window), candidates)).indices
    return torch.cat([top, torch.arange(candidates, prompt)]).sort().values


def omnikv() -> None:
    print("OmniKV uniform/exp before issue 62 vs the release (float32), k 256, window 16:")
    for selector in ("uniform", "exp"):
        sets = []
        for seed in range(3):
            for prompt in (2048, 4096):
                q, k, _ = tensors(seed, prompt + 20, 1.5)
                for step in (1, 4, 8, 12, 16, 18):
                    pos = prompt + step - 1
                    window = q[:, pos - 15:pos + 1]
                    release = refs.omnikv_release_select(window, k[:, :pos + 1], prompt, step, 256, 16, selector)
                    positions = torch.arange(pos - 15, pos + 1)
                    before = omnikv_before(window, k[:, :prompt], prompt, positions, 256, selector)
                    sets.append(jaccard(before.tolist(), release.tolist()))
        print(f"  {selector}: {sum(s == 1 for s in sets)}/{len(sets)} sets equal, Jaccard min {min(sets):.3f}")
    print("OmniKV scoring_dtype=release vs the release in float16, and float16 vs float32 selection (4K, k 256):")
    for selector in ("last", "uniform", "exp"):
        same, cross = [], []
        for seed in range(3):
            q, k, _ = tensors(seed, 4116, 1.5)
            for step in (1, 8, 17):
                pos = 4096 + step - 1
                window = q[:, pos - 15:pos + 1]
                release = refs.omnikv_release_select(window, k[:, :pos + 1], 4096, step, 256, 16, selector,
                                                     torch.float16)
                ours = omnikv_kvbench(window, k, 4096, step, 256, selector, torch.float16)
                in_float32 = omnikv_kvbench(window, k, 4096, step, 256, selector, torch.float32)
                same.append(jaccard(ours.tolist(), release.tolist()))
                cross.append(jaccard(ours.tolist(), in_float32.tolist()))
        print(f"  {selector}: {sum(s == 1 for s in same)}/{len(same)} equal to the release; float16 vs float32 "
              f"Jaccard min {min(cross):.3f} mean {sum(cross) / len(cross):.3f}")


def quest() -> None:
    print("Quest: one set per KV group with exactly B tokens (quest_page16 before issue 62) vs the release:")
    for length in (2048, 8192):
        for budget in (256, 1024):
            sets, diffs = [], []
            for seed in range(2):
                q, k, v = tensors(seed, length, 1.0)
                query = q[:, -1]
                mask, release = refs.quest_release(query, k, v, budget, 16)
                pages = PageSummary.of(k, 16)
                grouped = query.view(KV_HEADS, GROUP, DIM)
                bound = page_scores(grouped, pages.kmin, pages.kmax, None, grouped > 0).sum(1)
                rows = top_page_tokens(bound, 16, length, budget).repeat_interleave(GROUP, 0)
                sets += [jaccard(rows[h].tolist(), mask[h].nonzero()[:, 0].tolist()) for h in range(Q_HEADS)]
                at = rows[..., None].expand(-1, -1, DIM)
                keys, values = (t.repeat_interleave(GROUP, 0).gather(1, at) for t in (k, v))
                probs = torch.softmax((query[:, None] @ keys.transpose(1, 2))[:, 0] / math.sqrt(DIM), -1)
                diffs.append(float(((probs[:, None] @ values)[:, 0] - release).abs().max()))
            print(f"  L {length}, B {budget}: Jaccard per query head min {min(sets):.2f} "
                  f"mean {sum(sets) / len(sets):.2f}, max |output difference| {max(diffs):.3f}")


def hsa() -> None:
    print("HSA on float16 tensors: overlap with the release's float16 set, scoring_dtype=release and float32:")
    for length, budget in ((4096, 256), (4096, 1024), (8192, 256)):
        overlap = {torch.float16: [], torch.float32: []}
        for seed in range(3):
            q, k, _ = tensors(seed, length, 1.0)
            query, keys = q[:, -1].view(KV_HEADS, GROUP, DIM).half(), k.half()
            plan, k2 = hsa_parameters(length / budget, DIM), budget // 2
            release = refs.hsa_release_select(query, keys, length / budget, k2)
            pages = PageSummary.of(keys, plan["page_size"])
            for dtype, found in overlap.items():
                got = hsa_select(query, pages, plan["k1"], k2, length, dtype)[:, 0]
                found += [len(set(a.tolist()) & set(b.tolist())) / k2 for a, b in zip(got, release)]
        print(f"  S {length}, t {budget}: release arithmetic min {min(overlap[torch.float16]):.3f} mean "
              f"{sum(overlap[torch.float16]) / 24:.3f}; float32 min {min(overlap[torch.float32]):.3f} mean "
              f"{sum(overlap[torch.float32]) / 24:.3f}")


def adakv() -> None:
    short, diffs, overlaps = [], [], []
    for seed in range(4):
        for length in (2048, 4096):
            q, k, _ = tensors(seed, length, 1.5)
            for budget in (128, 512, 1024):
                base = budget - 32
                scores = {}
                for dtype in (torch.float32, torch.bfloat16):
                    window = release_window_scores(q[:, -32:].to(dtype), k.to(dtype), DIM ** -0.5, "mean")
                    scores[dtype] = F.max_pool1d(window, 7, stride=1, padding=3)
                release = allocate(scores[torch.float32], KV_HEADS * base, 0.2, rounding="release")
                short.append(KV_HEADS * base - sum(release))
                budgets = {dtype: allocate(s, KV_HEADS * base, 0.2) for dtype, s in scores.items()}
                diffs.append(max(abs(a - b) for a, b in zip(*budgets.values())))
                for h in range(KV_HEADS):
                    kept = [set(s[h].topk(budgets[dtype][h]).indices.tolist()) for dtype, s in scores.items()]
                    overlaps.append(len(kept[0] & kept[1]) / max(map(len, kept)))
    print(f"Ada-KV: the release's rounding misses H*b by {min(short)} to {max(short)} tokens; bfloat16 vs float32 "
          f"scores: per-head budgets differ by up to {max(diffs)} tokens, kept sets overlap min {min(overlaps):.3f} "
          f"mean {sum(overlaps) / len(overlaps):.3f}")


if __name__ == "__main__":
    omnikv()
    quest()
    hsa()
    adakv()
