"""Sandbox providers for agent harnesses: each module plugs agentenv sandboxes into one program's own extension
point (``inspect_ai_sandbox``: inspect-ai's ``SandboxEnvironment``), and imports only that program's package
besides agentenv. Nothing is imported here, so importing this room costs nothing and needs no extra."""
