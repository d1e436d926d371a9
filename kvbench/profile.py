"""`python -m kvbench.profile ...`: `python -m kvbench ...` with `profile=true` (see kvbench.cli.profile)."""

from kvbench.cli.profile import run

if __name__ == "__main__":
    run()
