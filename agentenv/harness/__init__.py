"""Sandbox providers for agent harnesses: each module plugs agentenv sandboxes into one program's own extension
point (``minisweagent``: mini-swe-agent's Environment; ``swerex``: SWE-ReX's deployment and runtime;
``inspect_ai_sandbox``: inspect-ai's ``SandboxEnvironment``; ``harbor``: harbor's ``BaseEnvironment``), importing
only that program's package and agentenv's public API. Install one with its extra (``agentenv[minisweagent]``, ...).
Nothing is imported here, so ``import agentenv.harness`` needs none of them.
"""
