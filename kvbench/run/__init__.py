"""Experiment points: identity, running one (or a group decoded together), out-of-memory and profiling policy."""
