import kvbench._unshadow  # noqa: F401, I001 - first: a folder named kvbench in the working directory

from kvbench.cli.main import main

main()
