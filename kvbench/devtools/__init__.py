"""Development tools: checks a developer runs on the CPU for what a GPU would refuse, outside the runtime layers.

`graph_lint` lints the compiled decode step's graph for what Triton's code generation refuses; `cuda_target`
compiles Triton kernels for a CUDA target without a GPU; `static_decode` is the check of every method's compiled
decode step (`scripts/check_static_decode.py`). Nothing a run imports depends on them (the import contract in
pyproject.toml puts them above every runtime layer).
"""
