"""Every method's decode step on the static layout: how many graphs it compiles, whether it recompiles or breaks
the graph, and whether its tokens equal the eager path's.

    python scripts/check_static_decode.py                              # tiny Llama + Qwen3, dynamo's eager backend
    python scripts/check_static_decode.py --backend inductor --methods full,quest,adakv
    python scripts/check_static_decode.py --backend inductor --device cuda --models tiny_llama   # Triton's code
    python scripts/check_static_decode.py --lint                       # and what Triton would refuse (CPU)
    TORCH_LOGS=recompiles,graph_breaks python scripts/check_static_decode.py --methods rocketkv

The check, what it reports and when it fails: `kvbench.devtools.static_decode` (its docstring, its `STATIC` and
`EAGER` tables, `check`, `main`); this is its command line.
"""

import sys

from kvbench.devtools.static_decode import main

if __name__ == "__main__":
    sys.exit(1 if any(not o.ok for o in main()) else 0)
