"""`python -m tierlm` runs the CLI."""

from tierlm.cli.app import main

main()
