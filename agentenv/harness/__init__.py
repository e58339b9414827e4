"""Sandbox providers for agent harnesses: each module makes agentenv sandboxes the execution backend of one program
(``minisweagent``: mini-swe-agent's Environment; ``swerex``: SWE-ReX's deployment and runtime), importing only that
program's package and agentenv's public API. Install one with its extra (``agentenv[minisweagent]``, ...).
Nothing is imported here, so ``import agentenv.harness`` needs none of them.
"""
