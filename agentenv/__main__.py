"""``python -m agentenv ...``: the same command line as the ``agentenv`` console script."""

from agentenv.cli import main

main()
