"""The one decode attention: a single query token per head over the layer's stored rows, for every method.

Every method's dense decode step (`full` included, uniform and ragged layers alike) calls `decode_attention`,
so latency comparisons between methods are made on one kernel. It picks the implementation by where the
tensors live and their dtype; every choice computes the same function, documented on
`decode_attention_reference`:

- **float32 on CPU**: stock SDPA, the call transformers' "sdpa" attention makes (one call on a uniform layer,
  one per KV head on a ragged one), so an uncompressed float32 forward stays bitwise identical to stock
  transformers' at the same rows (a decode step's rows are padded to a block: `kvbench.engine.invariance`).
- **bfloat16 on a CPU with AMX** (`LOW_PRECISION_CPU_SDPA`): the same stock SDPA call as float32. There
  PyTorch's CPU flash attention multiplies bf16 tiles on AMX: 24 us per layer over 256 rows against 108 for
  the matmuls below, 670 against 869 over 8,064 rows (30 SmolLM2 layers streamed from memory, 2 cores,
  2026-11-25), and a bfloat16 run is then bitwise stock transformers as well.
- **bfloat16 / float16 on other CPUs**: two batched matmuls in the model's dtype with a float32 softmax between
  them (`decode_attention_matmul`). There PyTorch's CPU SDPA ran one bf16 query 8-10x slower than this (an
  AVX512-BF16 Xeon without AMX, 2026-11-24); the matmuls stream K and V once at the BLAS's rate. The logits are rounded
  to the model's dtype before the float32 softmax, exactly as transformers' own eager attention does
  (`matmul(q, k^T) * scaling` in the model dtype); `tests/test_decode_attention.py` bounds the difference.
  A small ragged layer is copied into one padded batch with per-head lengths (`PADDED_COPY_ROWS`), a large
  one is attended head by head on views.
- **CUDA**: a ragged layer runs the Triton kernel (`ragged_decode_attention_triton`); a uniform one runs SDPA
  restricted to the flash, memory-efficient and math backends. (The compiled decode step on the static layout
  runs neither: its dense attention is the split-K operator of `kvbench.kernels.flash_decode`.) cuDNN's backend is left out for decode: it
  builds a new plan for every new KV length, which cost more than the attention itself on an H100 (docs/journal/gpu.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from kvbench.kernels._dispatch import use_triton
from kvbench.kernels.ragged_attention import ragged_decode_attention_reference, ragged_decode_attention_triton


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    starts: Sequence[int],
    lens: Sequence[int],
    caps: Sequence[int],
) -> torch.Tensor:
    """`decode_attention_reference`'s result by the implementation for these tensors (see the module).

    q: [H_kv, G, D]; keys/values: a layer's flat row buffers [R, D], KV head h's tokens at rows
    `starts[h] .. starts[h] + lens[h]` and free rows up to `starts[h] + caps[h]`. Returns [H_kv, G, D] in q's
    dtype. A uniform layer (equal lengths and capacities, heads evenly strided) is attended in one batched call.
    Rows past a head's length must hold finite values (the cache's slack holds zeros or tokens a sharing clone
    appended): the low-precision CPU path reads up to `WIDTH_STEP - 1` of them with zero weight.
    """
    _check_layout(q, keys, values, starts, lens, caps)
    n_kv, group, dim = q.shape
    uniform = len(set(lens)) == 1 and len(set(caps)) == 1 and list(starts) == [h * caps[0] for h in range(n_kv)]
    if not uniform and use_triton(q, keys, values):
        offsets = torch.as_tensor(list(starts), dtype=torch.int64, device=q.device)
        return ragged_decode_attention_triton(q, keys, values, offsets, lens, scaling)
    low_precision_cpu = _runs_matmuls(q.dtype, q.device)
    width = _stepped_width(max(lens))
    if not uniform and low_precision_cpu and n_kv * width <= PADDED_COPY_ROWS:
        rows = torch.as_tensor(list(starts), device=q.device)[:, None] + torch.arange(width, device=q.device)
        rows = rows.clamp_(max=keys.shape[0] - 1).view(-1)  # rows past a head's length get no weight
        padded_keys, padded_values = (t.index_select(0, rows).view(n_kv, width, dim) for t in (keys, values))
        lengths = torch.as_tensor(list(lens), device=q.device)
        return decode_attention_matmul(q, padded_keys, padded_values, scaling, lengths, width)
    if uniform:  # [H_kv, cap, D] views of the buffers
        head_keys = [keys[: n_kv * caps[0]].view(n_kv, caps[0], dim)]
        head_values = [values[: n_kv * caps[0]].view(n_kv, caps[0], dim)]
        head_lens, head_caps, head_q = [lens[0]], [caps[0]], [q]
    else:
        head_keys = [keys[s:s + c][None] for s, c in zip(starts, caps)]
        head_values = [values[s:s + c][None] for s, c in zip(starts, caps)]
        head_lens, head_caps, head_q = list(lens), list(caps), [q[h:h + 1] for h in range(n_kv)]
    outs = []
    for qh, k, v, n, cap in zip(head_q, head_keys, head_values, head_lens, head_caps):
        if not low_precision_cpu:
            with _decode_sdpa_backends(q):  # exactly transformers' sdpa decode call: [1, H_q, 1, D], GQA
                out = F.scaled_dot_product_attention(qh.reshape(1, -1, 1, dim), k[None, :, :n], v[None, :, :n],
                                                     scale=scaling, enable_gqa=True)
            outs.append(out.view(qh.shape))
        else:
            outs.append(decode_attention_matmul(qh, k, v, scaling, n, min(cap, _stepped_width(n))))
    return outs[0] if uniform else torch.cat(outs)


def static_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    fill: torch.Tensor,
    width: int | None,
    row_head: torch.Tensor | None,
    row_slot: torch.Tensor | None,
) -> torch.Tensor:
    """`decode_attention_reference`'s function on the static decode layout (`kvbench.cache.static`): the lengths
    are device tensors and every shape is fixed by the capacity, so a compiled step is one graph at every step.

    q: [H_kv, G, D]; fill: [H_kv] int64 tokens per head. Uniform layers (`width`): keys/values [H_kv * width, D],
    head h at rows h * width .. + width, its first fill[h] slots held. Ragged layers (`width` None): keys/values
    the flat [R, D] buffers, `row_head`/`row_slot` [R] the owner and slot of every row; each row is read once,
    by one product of all query heads with it (K q^T), and each query head's softmax keeps its own head's held
    rows. Logits as `decode_attention_matmul` (the model's dtype, then a float32 softmax). Returns [H_kv, G, D].
    """
    n_kv, group, dim = q.shape
    if width is not None:
        k, v = keys.view(n_kv, width, dim), values.view(n_kv, width, dim)
        logits = torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2).float() * scaling  # [H, G, W]
        past = torch.arange(width, device=q.device)[None, :] >= fill[:, None]
        probs = torch.softmax(logits.masked_fill(past[:, None, :], float("-inf")), dim=-1).to(values.dtype)
        return torch.matmul(probs, v)
    logits = torch.matmul(keys, q.reshape(n_kv * group, dim).t()).float() * scaling  # [R, H_kv * G]
    owner = torch.arange(n_kv, device=q.device).repeat_interleave(group)  # the KV head of each query head
    held = (row_head[:, None] == owner[None, :]) & (row_slot < fill[row_head])[:, None]
    probs = torch.softmax(logits.masked_fill(~held, float("-inf")), dim=0).to(values.dtype)
    return torch.matmul(probs.t(), values).view(n_kv, group, dim)


def _cpu_has_amx() -> bool:
    is_supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_supported()) if is_supported is not None else False


# Which bf16 CPU decode attention this machine runs: fixed per kind of CPU (never by timing, which would make
# records depend on a measurement), and written into each point's manifest (`decode_attention_kind`).
LOW_PRECISION_CPU_SDPA = _cpu_has_amx()


def decode_attention_kind(dtype: torch.dtype, device: torch.device) -> str:
    """Which implementation `decode_attention` runs for a uniform layer of this dtype on this device."""
    if device.type == "cuda":  # the compiled step's static layout attends by the split-K kernel (`flash_decode`)
        return "sdpa (flash, memory-efficient, math)"
    return "matmul" if _runs_matmuls(dtype, device) else "sdpa"


def _runs_matmuls(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this dtype on this device takes the two-matmul path (low precision on a CPU, bf16 without AMX)."""
    return (device.type != "cuda" and dtype != torch.float32
            and not (LOW_PRECISION_CPU_SDPA and dtype == torch.bfloat16))


WIDTH_STEP = 64
# A ragged layer on the low-precision CPU path is copied into one padded [H_kv, width, D] batch when that is at
# most this many rows: one batched call instead of one per head (each oneDNN call on a few hundred rows costs
# about as much as copying a thousand), so Ada-KV's small ragged layers cost what a uniform one does. Larger
# ragged layers keep one call per head on views, which reads each row once.
PADDED_COPY_ROWS = 4096


def _stepped_width(length: int) -> int:
    """`length` rounded up to whole `WIDTH_STEP` blocks: the matmul path's row count."""
    return -(-length // WIDTH_STEP) * WIDTH_STEP


def decode_attention_matmul(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                            length: int | torch.Tensor, width: int) -> torch.Tensor:
    """q [H, G, D] over the first `length` rows of keys/values [H, >= width, D] (an int, or one length per
    head `[H]`): logits by a batched matmul in q's dtype, a float32 softmax, the probabilities cast back and
    multiplied with the values (transformers' eager attention, per KV group).

    The matmuls run over `width` >= `length` rows with the logits past `length` set to -inf (zero weight):
    oneDNN builds a kernel for every new matrix shape (about 0.6 ms on a 2-core CPU, more than the attention
    over 8K tokens), so the width grows in steps of `WIDTH_STEP` rows of the slack the cache reserves for
    decoding instead of by one row per step. The logits are computed as K q^T, one streaming pass over the
    rows of K (q K^T made oneDNN copy a strided K first: 2.3x slower at 8K tokens).
    """
    keys, values = keys[:, :width], values[:, :width]
    logits = torch.matmul(keys, q.transpose(-1, -2)).transpose(-1, -2).float() * scaling
    if isinstance(length, int):
        logits[..., length:] = float("-inf")
    else:
        past = torch.arange(width, device=logits.device) >= length[:, None]  # [H, width]
        logits.masked_fill_(past[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


def decode_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    starts: Sequence[int],
    lens: Sequence[int],
    caps: Sequence[int] | None = None,
) -> torch.Tensor:
    """Single-token attention of each query head over its KV head's rows (PyTorch, float32 throughout).

    out[h, g] = softmax(scaling * q[h, g] . K_h) @ V_h with K_h = keys[starts[h] : starts[h] + lens[h]] (rows
    past a head's length are never attended, whatever they hold); returned as [H_kv, G, D] in q's dtype.
    """
    offsets = torch.as_tensor(list(starts), dtype=torch.int64, device=keys.device)
    return ragged_decode_attention_reference(q, keys, values, offsets, list(lens), scaling)


def _check_layout(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: Sequence[int],
                  lens: Sequence[int], caps: Sequence[int]) -> None:
    # host-side lists only: checking tensors' values would cost a device sync on every decode step
    ok = (q.dim() == 3 and keys.dim() == 2 and keys.shape == values.shape and keys.shape[1] == q.shape[2]
          and len(starts) == len(lens) == len(caps) == q.shape[0]
          and all(0 < n <= c for n, c in zip(lens, caps)) and max(s + c for s, c in zip(starts, caps)) <= keys.shape[0])
    if not ok:
        raise ValueError(f"decode attention layout: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}, starts {list(starts)}, lens {list(lens)}, caps {list(caps)}")


@contextlib.contextmanager
def _decode_sdpa_backends(q: torch.Tensor) -> Iterator[None]:
    """On CUDA, SDPA without the cuDNN backend (see the module docstring); on CPU, nothing changes."""
    if not q.is_cuda:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield
