"""Argument checks shared by every layer: one definition of what a count, a flag or a ratio is."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An integer, and not a bool (True is an int to Python, not a token count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)
