"""Small drawing helpers shared by the claims' figures (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
import numpy as np  # noqa: E402


def new_figure(columns: int = 1, width: float = 5.5, height: float = 3.8, rows: int = 1) -> tuple[Any, Any]:
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=True)
    return fig, axes


def cdf_axes(ax: Any, series: Mapping[str, Sequence[float]]) -> None:
    """Empirical CDFs, one step line per series."""
    for label, values in series.items():
        x = np.sort(np.asarray(values, dtype=float))
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
    ax.set_ylabel("CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save(fig: Any, out_dir: Path, name: str) -> list[Path]:
    """Write `fig` as PNG and PDF under `out_dir`; returns both paths."""
    fig.tight_layout()
    paths = [out_dir / f"{name}.png", out_dir / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=120)
    fig.savefig(paths[1])
    plt.close(fig)
    return paths
