"""`python -m specrt.cli`: the same command line as `specrt`."""
from specrt.cli import main

main()
