"""Rollouts: the token-in/token-out agent loop (``agent``), trajectory records and shards (``trajectory``), GRPO
groups forked from one state, the one group player of ``agentenv rollout`` and ``agentenv train`` (``groups``), an
episode paused between two turns (``pausing``), Ray rollout workers (``workers``), their driver (``driver``) and its
Ray plumbing (``raycluster``), what a run owns and its clean-up (``ownership``), a run's totals (``stats``),
fork-based search (``search``), a scripted policy for tests and demonstrations (``scripted``), scripted experts for
the shipped env families (``experts``), and ``agentenv rollout`` (``cli``).

Nothing is imported here: ``import rollout.trajectory`` stays light (no Ray, no torch)."""
