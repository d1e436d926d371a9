"""Whether this machine decodes a row to the same bits alone and in a batch (batch invariance), checked on the
model itself before any sample is batched.

A decode step's dense layers multiply a [rows, hidden] activation by each weight. Their kernels pick a code path
by the number of rows: with torch 2.13's CPU BLAS on x86, float32 products of 1-3 rows take a matrix-vector path
and 4 or more a GEMM in tiles of 4 rows, whose leftover rows (the 5th of 5, the 9th to 11th of 11) round otherwise
than a whole tile's (measured on an AVX-512 EPYC: rows of 4, 8, 12 and 16 equal a lone row padded to 4, rows past
the last whole tile of 5-7 and 9-11 do not); cuBLAS picks tiles and split-K by the shape. So the engine pads every
eager decode forward to a multiple of a block of rows (`EngineConfig.row_block`, `kvbench.engine.session
.step_batch`): a row then takes the same products alone as in a batch wherever the kernels give a row of a whole
block the same bits whatever the other rows hold. Elementwise and per-row operations (norms, rotary,
activations) are covered the same way, and each row's attention runs over its own cache alone.

That property belongs to the machine (its CPU kind, BLAS, thread count; a GPU's library heuristics), not to
kvbench, so it is measured, not assumed: `batch_invariance` decodes short random prompts of the loaded model one
row at a time and in batches of every size up to the largest the run will use, in several orders, and compares the
logits bitwise. Where any row differs the run decodes one row at a time and its records say why
(`decode_batch_reason`). The answer is kept per model, row counts and thread count for the process.
"""

from __future__ import annotations

import logging

import torch

from kvbench.engine.session import Session, step_batch
from kvbench.models import LoadedModel

log = logging.getLogger("kvbench")

PROBE_PROMPT_TOKENS = 6  # a short prompt: the dense layers' shapes do not depend on it, and it keeps the probe quick


def batch_invariance(lm: LoadedModel, max_rows: int, row_block: int) -> str | None:
    """None when a decode row's logits are bitwise the same alone and in every batch of up to `max_rows` rows
    (padded to `row_block`) on this machine, else the reason to decode one row at a time. Memoized."""
    key = (max_rows, row_block, torch.get_num_threads())
    known = lm.model.__dict__.setdefault("_kvbench_batch_invariance", {})
    if key not in known:
        known[key] = _probe(lm, max_rows, row_block)
        if known[key] is not None:
            log.warning("kvbench: %s; decoding one row at a time", known[key])
    return known[key]


@torch.inference_mode()
def _probe(lm: LoadedModel, max_rows: int, row_block: int) -> str | None:
    generator = torch.Generator().manual_seed(0)
    vocab = lm.model.config.vocab_size
    prompt = Session(lm, None, None)
    prompt.row_block = row_block
    prompt.prefill(torch.randint(vocab, (PROBE_PROMPT_TOKENS,), generator=generator).tolist(), compress=False)
    tokens = torch.randint(vocab, (max_rows,), generator=generator).tolist()  # rows differ by their next token
    alone = [step_batch([prompt.fork()], [token])[0] for token in tokens]
    # batches of a few sizes (a partial block, a block and one, the most rows), rows at every place of a block
    everyone = list(range(max_rows))
    orders = [everyone[:n] for n in sorted({2, row_block + 1, max_rows}) if 1 < n <= max_rows]
    orders += [everyone[::-1], everyone[1:] + everyone[:1]]
    for order in orders:
        together = step_batch([prompt.fork() for _ in order], [tokens[r] for r in order], max_rows)
        for r, logits in zip(order, together):
            if not torch.equal(logits, alone[r]):
                diff = float((logits - alone[r]).abs().max())
                return (f"this machine's kernels are not batch-invariant for {lm.name} in {str(lm.dtype)[6:]} "
                        f"(a row's logits alone and in a batch of {len(order)} rows differ by up to {diff:.3g}, "
                        f"row block {row_block}, {torch.get_num_threads()} threads)")
    return None
