"""The attention function registered with transformers, and the one place a forward calls the method."""

from kvbench.attention.dispatch import ATTENTION_NAME, kvbench_attention, register_attention

__all__ = ["ATTENTION_NAME", "kvbench_attention", "register_attention"]
