"""Pieces several methods share (RoPE on cached keys, growing buffers, page summaries, rows moved to the host).
A package like any other, so that the layers contract holds its modules too: they sit in the methods layer."""
