"""References written from the authors' released code, one module per release, for the release-parity suite
(tests/test_release_parity.py; the table of departures is docs/fidelity.md).

Each reference is this project's own code following the release's arithmetic step by step (the order of its
reductions, its masks, its pooling, its top-k and how it breaks ties); its docstring names the repository,
the commit and the file it follows. `harness` drives kvbench's methods on the same tensors through the entry
the engine uses (the registered attention function and the method's hooks on a `KVBenchCache`).
"""
