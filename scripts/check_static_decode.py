"""Every method's decode step on the static layout: how many graphs it compiles, whether it recompiles or breaks
the graph, and whether its tokens equal the eager path's.

    python scripts/check_static_decode.py                              # tiny Llama + Qwen3, dynamo's eager backend
    python scripts/check_static_decode.py --backend inductor --methods full,quest,adakv
    python scripts/check_static_decode.py --backend inductor --device cuda --models tiny_llama   # Triton's code
    python scripts/check_static_decode.py --lint                       # and what Triton would refuse (CPU)
    TORCH_LOGS=recompiles,graph_breaks python scripts/check_static_decode.py --methods rocketkv

For each model and method: one sample prefilled and compressed as a run does, then `--steps` greedy decode steps
through `Session.step`, eagerly and compiled (`engine.compile`, `torch.compile(fullgraph=True, dynamic=False)`
with `--backend`), from the same compressed cache. Then a second sample of another length in the same capacity
bucket, compiled: it must reuse the graph. Reported per method:

- graphs: graphs compiled over the first sample (1: the whole step is one graph);
- recompiles: graphs compiled after the first compiled step of that sample (must be 0), and over the second
  sample (`2nd`, must be 0: samples of similar length share the graph);
- breaks: a graph break under `fullgraph=True` is an error, named here;
- tokens: whether the greedy tokens equal the eager path's; max |logit| difference over the steps;
- replayed / guarded: the compiled steps that replayed their graph without dynamo (`kvbench.engine.replay`; a
  CUDA graph on CUDA) and those that went through dynamo's guards (at most three per graph key, so at most 6);
- stats: whether the decode statistics (layer steps, elements and rows read, recall) and the bytes held equal
  the eager path's;
- path: `compiled`, or `eager` and the reason the method gives (host work at every step).

`--backend eager` (the default; dynamo's tracing only) and `aot_eager` decide graphs, breaks and recompiles as
inductor does, in seconds; inductor also generates the kernels (a minute or more per graph on two cores).
`--lint` compiles with `kvbench.devtools.graph_lint`'s backend instead: each graph after inductor's
decompositions, checked for what Triton's code generation refuses although the CPU's accepts (a method with such
a construct runs compiled on the CPU and falls back to eager on every GPU), then run eagerly; a finding is the
method's error. The exit status is 1 when a method that should run compiled does not (a lint finding
included), recompiles, is not replayed, or changes a token or a statistic.

The check is `kvbench.devtools.static_decode` (its `STATIC` and `EAGER` tables, `check`, `main`); this is its
command line.
"""

import sys

from kvbench.devtools.static_decode import main

if __name__ == "__main__":
    sys.exit(1 if any(not o.ok for o in main()) else 0)
