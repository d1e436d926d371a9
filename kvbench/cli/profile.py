"""`python -m kvbench.profile ...`: the same command line as `python -m kvbench`, with `profile=true`.

    python -m kvbench.profile method=snapkv budget=256 task=synthetic task.seq_len=8192
    python -m kvbench.profile -m method=full,snapkv,adakv budget=256,1024 task=synthetic task.lengths=[2048,8192]
"""

from __future__ import annotations

import sys

from kvbench.cli.main import main


def run() -> None:
    if not any(arg.startswith(("profile=", "+profile=")) for arg in sys.argv[1:]):
        sys.argv.append("profile=true")
    main()
