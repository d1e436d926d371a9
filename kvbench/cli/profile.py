"""`kvbench profile ...` (or `python -m kvbench.profile ...`): the same command line as `python -m kvbench`, with
`profile=true`.

    python -m kvbench.profile method=snapkv budget=256 task=synthetic task.seq_len=8192
    python -m kvbench.profile -m method=full,snapkv,adakv budget=256,1024 task=synthetic task.lengths=[2048,8192]
"""

from __future__ import annotations

import sys

from kvbench.cli.main import main, with_profile


def run() -> None:
    sys.argv[1:] = with_profile(sys.argv[1:])
    main()
