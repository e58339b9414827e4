"""Rollouts: the token-in/token-out agent loop (``agent``), trajectory records and shards (``trajectory``), GRPO
groups forked from one state (``groups``), Ray rollout workers and their driver (``workers``), fork-based search
(``search``), a scripted policy for tests and demonstrations (``scripted``), and ``agentenv rollout`` (``cli``).

Nothing is imported here: ``import rollout.trajectory`` stays light (no Ray, no torch)."""
