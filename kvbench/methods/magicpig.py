"""MagicPIG (Chen et al. 2024, "MagicPIG: LSH Sampling for Efficient LLM Generation", arXiv 2410.16179; code
Infini-AI-Lab/MagicPIG, `models/attnserver.py` `LSHSparseAttnServer`, `library/lsh/lsh.cc`,
`library/sparse_attention/sparse_attention.cc`): attention estimated by importance sampling, the samples drawn
by SimHash locality-sensitive hashing over keys kept in host memory (CTKVR's baseline, its §4.1.2).

When the prompt's prefill ends, per layer (`keep` at the segment's end, as the code's `fill` + `build_table`):

- the first `n_sink` (4) and last `n_local` (64) prompt tokens stay resident in the layer's storage, and so does
  every token stored later (generated tokens, an appended question), all attended exactly;
- every other prompt row moves to host memory (`LSHSegment`, a `HostSegment` that also holds the hash codes);
- its keys are centred on their mean (`center_keys`, the code's `avg_k`) and hashed by SimHash: K random
  hyperplanes per table (sign bits packed into a K-bit bucket id), L tables, the hyperplanes drawn once from
  a seeded generator (`seed`) and shared by every layer and head, as the released server does.

Every decode step, per layer and per query head (the code's `batch_retrieve` runs once per attention head
over its KV head's tables):

1. the query is hashed with the same hyperplanes; a host key is *sampled* when it shares the query's bucket in
   at least 2 of the L tables (`lsh.cc` `retrieve`: a key enters the result at its second collision);
2. its sampling probability is the closed form from the angle theta between the query and the centred key:
   p = (1 - theta/pi)^K per table, u = P(Binomial(L, p) >= 2) = 1 - (1-p)^L - L p (1-p)^(L-1)
   (`sparse_attention.cc` `transform_kernel`);
3. the sampled rows are attended with logits q.k * scale - log(u + `weight_eps`), each query head its own
   sample (the union over the group is gathered once, -inf where a head did not sample a row), and merged by
   log-sum-exp with the exact attention over the resident rows: self-normalised importance sampling (the
   Horvitz-Thompson sums sum_S e^{s_i} v_i / u_i and sum_S e^{s_i} / u_i estimate the exact numerator and
   denominator without bias when `weight_eps` = 0).

Sparsity is dynamic: how many keys a step samples depends on the query and the keys (about 2% of the context
in MagicPIG, about 4% in CTKVR's runs), not on the budget. Each step records `sampled_fraction` (sampled rows over host rows, per query
head: the code's "Avg Sparsity"), `attended_fraction` ((resident + sampled) / all rows), `sampled_per_head`,
`sampled_per_group` (the union over a KV group) and `table_entries_per_head` (bucket entries the lookup reads)
in `Selection.extra`. The budget only decides compression at all: at or above the sequence the run is exactly
full attention (`uses_budget` stays True so sweeps keep the point); below it, every budget is the same run.

Cost model (`step_traffic`, elements of the model's dtype): the resident K/V; the sampled K/V, distinct rows per
KV group (kvbench's convention; the CPU kernel reads them per query head); the hash-table lookup as the code
does it, per query head and table the bucket's bounds (2 x int32) and its entries (one int32 row index per
collision), plus the sampled keys' fp32 norms. Hashing the query reads the D x K*L hyperplanes, a constant
shared by every layer like a weight matrix (cache-resident in the code), so it is not counted. The tables never
scan the K*L-bit codes of every key (kvbench compares the stored codes instead, which gives the same
collisions, and counts the table's reads). `moved_bytes`, with the host segment off the device: the query and its L codes out,
the host side's output and log-sum-exp back (as CTKVR counts it). Storage: every row is kept, on one side or the
other; the Table 1 ratio adds the codes' K*L bits per key and head as auxiliary elements, and the host bytes
are the tensors held (K/V, int16 codes, fp32 key norms, the centre).

Departures from the code, and why: kvbench attends with uncentred keys on both sides (centring shifts every
logit of a query by the same q.mean, which the merged softmax cancels; the hashing and the angles use the
centred keys as the code does); codes are compared directly instead of through sorted bucket tables (same
samples); the code's `dense_layers` default [0, 16, 32, 48, 64] (layers 0 and 16 on Llama-3-8B) is this
method's default too; the code's co-execution (GPU and CPU halves overlapped) is not reproduced: both halves
run one after the other. `weight_eps` keeps the code's +1e-4 (it caps a rare row's weight at 1e4; 0 gives the
paper's unbiased estimator). A chunk appended after the prompt (question, turn) attends densely to every row,
host rows included, and stays resident.

Against the release's sampling and importance weights on the same tensors (same hyperplanes):
docs/fidelity.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from kvbench.core.contract import Selection
from kvbench.methods.base import OffloadMethod, register_method
from kvbench.methods.common.placement import HostSegment, resident_and_host_recall

MIN_COLLISIONS = 2  # lsh.cc `retrieve`: a key is sampled at its second table collision with the query


@lru_cache(maxsize=16)
def simhash_planes(dim: int, bits: int, tables: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """The SimHash hyperplanes [D, K*L] fp32 (columns t*K .. t*K+K-1 are table t), from a seeded generator."""
    planes = torch.randn((dim, bits * tables), generator=torch.Generator().manual_seed(seed))
    return planes.to(device)


def code_dtype(bits: int) -> torch.dtype:
    return torch.int16 if bits <= 15 else torch.int32  # the code stores int16 bucket ids (K <= 15)


def simhash(x: torch.Tensor, planes: torch.Tensor, tables: int) -> torch.Tensor:
    """Bucket ids [..., L] of vectors x [..., D]: per table, the K sign bits of x . plane packed little-endian.
    `planes` [D, K*L] (or a batch of draws [N, D, K*L], broadcast against x)."""
    bits = planes.shape[-1] // tables
    signs = (x.float() @ planes) > 0
    weights = 2 ** torch.arange(bits, device=x.device, dtype=torch.int32)
    return (signs.unflatten(-1, (tables, bits)).to(torch.int32) * weights).sum(-1).to(code_dtype(bits))


def collision_counts(q_codes: torch.Tensor, k_codes: torch.Tensor, chunk: int) -> torch.Tensor:
    """Tables in which each query head shares each key's bucket: q_codes [H, G, L], k_codes [H, M, L] ->
    [H, G, M] int16, `chunk` keys at a time (bounded memory)."""
    heads, group, _ = q_codes.shape
    parts = [(k_codes[:, None, start:start + chunk] == q_codes[:, :, None]).sum(-1, dtype=torch.int16)
             for start in range(0, k_codes.shape[1], chunk)]
    return torch.cat(parts, dim=-1) if parts else q_codes.new_zeros((heads, group, 0), dtype=torch.int16)


def sampling_probability(cos: torch.Tensor, bits: int, tables: int) -> torch.Tensor:
    """u = P(a key collides with the query in >= 2 of L tables of K bits) from their cosine (float64):
    p = (1 - theta/pi)^K, u = 1 - (1-p)^(L-1) (1 + (L-1) p), written with log1p/expm1 so a small u keeps its
    precision (u ~ L(L-1)/2 p^2)."""
    theta = torch.arccos(cos.double().clamp(-1.0, 1.0))
    p = (1.0 - theta / math.pi) ** bits
    return -torch.expm1((tables - 1) * torch.log1p(-p) + torch.log1p((tables - 1) * p))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu").pin_memory() if t.device.type == "cuda" else t.to("cpu")


@dataclass(frozen=True)
class LSHSegment(HostSegment):
    """Host rows of one layer with their hash codes [H, M, L], centred-key norms [H, M] fp32 and the centre
    [H, 1, D] fp32 (the code's `avg_k`, from the rows hashed at the prompt's end)."""

    codes: torch.Tensor | None = None
    norms: torch.Tensor | None = None
    center: torch.Tensor | None = None
    bits: int = 0

    def truncate(self, layer) -> "LSHSegment":
        keep = self.positions[0] < layer.seen
        if bool(keep.all()):
            return self
        return LSHSegment(self.keys[:, keep].clone(), self.values[:, keep].clone(), self.positions[:, keep].clone(),
                          self.codes[:, keep].clone(), self.norms[:, keep].clone(), self.center, self.bits)

    @property
    def paper_elements(self) -> int:  # the codes' K*L bits per key and head, in K/V elements (Table 1's aux)
        return self.codes.numel() * self.bits // (8 * self.keys.element_size())


@register_method
@dataclass
class MagicPIG(OffloadMethod):
    name = "magicpig"
    host_work = "MagicPIG's LSH sampling runs over keys in host memory at every decode step"
    dense_layers: int | list[int] | None = field(default_factory=lambda: [0, 16, 32, 48, 64])  # the code's
    K: int = 9  # hash bits (hyperplanes) per table
    L: int = 120  # hash tables
    n_sink: int = 4  # resident initial tokens
    n_local: int = 64  # resident last prompt tokens
    seed: int = 0  # the hyperplanes' generator
    weight_eps: float = 1e-4  # log-weight -log(u + eps): the code's 1e-4; 0 is the unbiased estimator
    center_keys: bool = True  # hash and measure angles on keys minus the host keys' mean (the code's avg_k)
    hash_chunk: int = 8192  # keys hashed / compared at once (bounds memory; the code's chunk_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        limits = {"K": (1, 31), "L": (MIN_COLLISIONS, None), "n_sink": (0, None), "n_local": (0, None),
                  "seed": (0, None), "hash_chunk": (1, None)}
        for name, (low, high) in limits.items():
            value = getattr(self, name)
            if value < low or (high is not None and value > high):
                bound = f">= {low}" + (f" and <= {high}" if high is not None else "")
                raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
        eps = self.weight_eps
        if not eps >= 0:
            raise ValueError(f"weight_eps must be a number >= 0, got {eps!r}")

    # the "eviction" event (`OffloadMethod.schedule`) moves the prompt's middle to host memory and hashes it
    def plan_derived(self, budget, prompt):
        # the budget sets nothing else: the samples per step are dynamic (module doc)
        return {"K": self.K, "L": self.L, "min_collisions": MIN_COLLISIONS, "n_sink": self.n_sink,
                "n_local": self.n_local, "dynamic_sparsity": True}

    def planes(self, dim: int, device: torch.device) -> torch.Tensor:
        return simhash_planes(dim, self.K, self.L, self.seed, str(device))

    # -- prefill end: offload the prompt's middle, hash it --------------------------------------------------
    def keep(self, layer, budget, step):
        if layer.derived.get("host") is not None:
            return None  # already offloaded
        view = layer.head_view()
        positions = view.positions[0]
        moving = (positions >= self.n_sink) & (positions < layer.seen - self.n_local)
        if not bool(moving.any()):
            return None  # the prompt is all sink and local tokens: nothing to sample from
        rows = torch.nonzero(moving).flatten()
        keys = view.keys.index_select(1, rows).float()
        center = keys.mean(dim=1, keepdim=True) if self.center_keys else keys.new_zeros((keys.shape[0], 1, keys.shape[2]))
        planes = self.planes(keys.shape[-1], keys.device)
        codes, norms = [], []
        for start in range(0, keys.shape[1], self.hash_chunk):
            centred = keys[:, start:start + self.hash_chunk] - center
            codes.append(simhash(centred, planes, self.L))
            norms.append(centred.norm(dim=-1))
        moved = HostSegment.of(view.keys, view.values, view.positions, rows)
        layer.derived["host"] = LSHSegment(moved.keys, moved.values, moved.positions, _to_host(torch.cat(codes, 1)),
                                           _to_host(torch.cat(norms, 1)), _to_host(center), self.K)
        return [torch.nonzero(~moving).flatten()] * layer.num_heads

    # -- decode ---------------------------------------------------------------------------------------------
    def select(self, layer, q, view, step, scaling):
        host = layer.derived.get("host")
        if not isinstance(host, LSHSegment):
            return None
        heads, group, dim = q.shape
        n_res, n_host = view.keys.shape[1], host.keys.shape[1]
        if n_host == 0:
            return None  # a rollback emptied the host side: every row is resident
        resident = torch.arange(n_res, device=q.device).expand(heads, group, n_res)
        where = host.keys.device
        q_codes = simhash(q, self.planes(dim, q.device), self.L)  # hashed where the query is, as the code does
        counts = collision_counts(q_codes.to(where), host.codes, self.hash_chunk)  # [H, G, M]
        sampled = counts >= MIN_COLLISIONS
        union = sampled.any(dim=1)  # [H, M]: the rows some head of the group sampled
        width = int(union.sum(dim=1).max())
        rows = torch.sort((~union).to(torch.int8), dim=-1, stable=True).indices[:, :width]  # in storage order
        valid = union.gather(1, rows)
        gather = rows[..., None].expand(-1, -1, dim)
        keys, values = host.keys.gather(1, gather), host.values.gather(1, gather)
        own = sampled.gather(2, rows[:, None, :].expand(-1, group, -1)) & valid[:, None, :]
        log_weights = self.log_weights(q.to(where), keys, host.norms.gather(1, rows), host.center)
        log_weights = log_weights.masked_fill(~own, float("-inf"))
        recall = None
        if step.measure_recall:  # over every token: resident and host
            recall = resident_and_host_recall(q, view.keys, host.keys, rows, valid, scaling)
        moved = 0 if where == q.device else (2 * q.numel() + heads * group + q_codes.numel()) * 4
        per_head = sampled.sum(dim=-1).float()  # [H, G]
        extra = {
            "sampled_fraction": float(per_head.mean()) / max(n_host, 1),
            "attended_fraction": (n_res + float(per_head.mean())) / (n_res + n_host),
            "sampled_per_head": float(per_head.mean()),
            "sampled_per_group": float(union.sum(dim=1).float().mean()),
            "table_entries_per_head": float(counts.sum(dim=-1, dtype=torch.float32).mean()),
        }
        return Selection(resident, external=(keys, values, valid, log_weights), recall=recall, moved_bytes=moved,
                         extra=extra)

    def log_weights(self, q: torch.Tensor, keys: torch.Tensor, norms: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
        """-log(u + eps) [H, G, m] fp32 for query heads q [H, G, D] and host rows keys [H, m, D] whose centred
        norms are `norms` [H, m]: u from the angle between the query and the centred key (the code's `kn`)."""
        dots = torch.einsum("hgd,hmd->hgm", q.float(), keys.float() - center)
        scale = q.float().norm(dim=-1, keepdim=True) * norms[:, None, :]
        cos = dots / scale.clamp(min=torch.finfo(torch.float32).tiny)
        u = sampling_probability(cos, self.K, self.L)
        return (-torch.log(u + self.weight_eps)).float()

    def step_traffic(self, layer, selection, step):
        """Elements one step reads by MagicPIG's own lookup (module doc): bucket bounds and entries, the
        sampled keys' norms, sampled (distinct per group) and resident K/V."""
        if selection is None or selection.external is None:
            return super().step_traffic(layer, None, step)
        keys, _, valid, _ = selection.external
        heads, group = selection.idx.shape[:2]
        dim, union = layer.head_dim, int(valid.sum())
        entries = selection.extra["table_entries_per_head"] * heads * group
        index_bytes = 4 * (entries + 2 * self.L * heads * group + union)
        return int(2 * dim * (sum(layer.lengths()) + union) + index_bytes / keys.element_size())
