"""Latency and memory per phase on the accuracy code path, and roofline ratios."""
