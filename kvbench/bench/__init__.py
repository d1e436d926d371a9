"""The measurement scripts' shared code: timing, read rates, the stock and random models they compare against.

`scripts/bench_*.py` and `scripts/gpu_*.py` are thin entry points over these modules (a script never imports
another): `timing` (a callable's median time, a device's copy and read rates, the engine's decode steps timed),
`shapes` (the model-shape flags, the random and stock Llama models of those shapes, the selections' top-k shapes)
and `eager_floor` (the cheapest eager decode step of a model, written out by hand). The runtime never imports
them (the import contract in pyproject.toml puts them above every runtime layer).
"""
