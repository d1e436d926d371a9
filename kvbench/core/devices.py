"""Device helpers shared by the engine and the profilers."""

from __future__ import annotations

import functools

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def start_cpu_threads() -> None:
    """Start the process's OpenMP worker threads with one throwaway parallel operation, before any model exists.

    On a 2-core AMX Xeon (torch 2.13, libgomp), the parallel region that creates the worker threads sometimes
    computed the worker's share differently from every later region: in 9 of 60 fresh processes, the first
    prefill's rotary embedding differed from a second identical prefill on exactly the rows of the second
    thread's half (up to 1.5e-4), so the first point of a process was not bitwise reproducible (and
    `test_budget_at_or_above_the_sequence_is_bitwise_full` failed now and then). With the threads started first
    by this call: 0 of 180 processes, and 0 of 50 runs of that test (the root cause, somewhere in the worker's
    start-up, was not found; with one thread: 0 of 40). A cosine over 2^20 elements is far above ATen's grain
    size, so it runs on every thread; about a millisecond, once per process (cached)."""
    if torch.get_num_threads() > 1:
        torch.ones(1 << 20).cos_()
