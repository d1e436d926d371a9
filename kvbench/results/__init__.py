"""Per-point result storage (records, manifest, summary) and reading a results tree as a table."""

from kvbench.results.collect import collect, load, results_root, scores
from kvbench.results.manifest import build_manifest, write_manifest
from kvbench.results.store import RecordStore, load_records, point_hash, point_lock, to_jsonable
from kvbench.results.summary import summarize, write_summary

__all__ = ["RecordStore", "build_manifest", "collect", "load", "load_records", "point_hash", "point_lock",
           "results_root", "scores", "summarize", "to_jsonable", "write_manifest", "write_summary"]
