"""The one exception type the CLI turns into a single readable error line (no traceback wall)."""

from __future__ import annotations


class KVBenchError(RuntimeError):
    """A user-facing error: bad config, missing model or data, impossible request."""
