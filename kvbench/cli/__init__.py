"""Thin entry points: `python -m kvbench` (run), `kvbench report`, and the `-m` modules figures, export, profile."""

from kvbench.cli.main import main

__all__ = ["main"]
