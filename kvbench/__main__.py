from kvbench.cli.main import main

main()
