"""`python -m kvbench.profile ...`: `python -m kvbench ...` with `profile=true` (see kvbench.cli.profile)."""

import kvbench._unshadow  # noqa: F401, I001 - first: a folder named kvbench in the working directory
from kvbench.cli.profile import run

if __name__ == "__main__":
    run()
