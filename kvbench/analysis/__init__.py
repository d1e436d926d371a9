"""`kvbench analyze`: each of the five papers' observations about attention, measured on a model, with a verdict.

trace (one sample's full-cache run, every query kept) -> claims/<name>.py (one module per claim: its
measurement per sample, its verdict rule, its figure) -> base (bootstrap interval and verdict) -> runner
(directory, resumable records, verdict.json, figure).
"""
