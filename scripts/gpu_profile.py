"""`python -m kvbench.profile ...` with random `source: tiny` models initialised on their own device.

    python scripts/gpu_profile.py -m experiment=rocketkv_fig7 model=tiny_llama model.device=cuda ...

`load_model` builds a tiny (random) model on the CPU and then moves it: seconds for the test models, but
about 7 minutes on the GPU machine of docs/gpu/README.md for Llama-3.1-8B's shapes (7B fp16 parameters
initialised by the CPU). This runner builds such a model directly on `model.device` (the same code under a
`torch.device` context: seconds on a GPU). The weights' values differ from a CPU build with the same
`init_seed`, which a latency or memory profile does not see; everything else is `kvbench.profile`.
"""

from __future__ import annotations

import sys

import torch

import kvbench.models as models

_load_tiny = models._load_tiny


def _load_tiny_on_device(cfg, dtype, *placement):
    with torch.device(models.resolve_device(cfg.device)):
        return _load_tiny(cfg, dtype, *placement)


if __name__ == "__main__":
    models._load_tiny = _load_tiny_on_device
    if not any(arg.startswith(("profile=", "+profile=")) for arg in sys.argv[1:]):
        sys.argv.append("profile=true")
    from kvbench.cli.main import main

    main()
