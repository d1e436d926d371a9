"""`scoring_dtype`: the arithmetic a method scores tokens in, one setting name across methods.

- null / `float32` (the default): kvbench's choice. The scores are computed in float32 from the stored keys
  and queries, so a selection is the same on every backend and in every model dtype (up to summation order).
- `release`: the arithmetic of the authors' release, where it differs (docs/fidelity.md lists each): OmniKV's
  and RocketKV's HSA scores in float16 (their models are loaded in float16), Ada-KV's in the model's dtype.
  Presets that reproduce a paper's table use it.

A null setting keeps the point identity of the runs made before the setting existed (a null method parameter
is left out of the point's hash); the records name the setting in `method_params`.
"""

from __future__ import annotations

import torch

SCORING_DTYPES = ("float32", "release")


def check_scoring_dtype(value: str | None) -> None:
    if value is not None and value not in SCORING_DTYPES:
        raise ValueError(f"scoring_dtype must be float32, release or null (float32), not {value!r}")


def scoring_dtype(setting: str | None, release: torch.dtype) -> torch.dtype:
    """The dtype scores are computed in: `release` (the release's dtype) under `scoring_dtype=release`, else
    float32."""
    return release if setting == "release" else torch.float32
