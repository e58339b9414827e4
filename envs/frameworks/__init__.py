"""Environment adapters for RL frameworks: agentenv's Gymnasium envs (``agentenv/SWE-v0``, ``agentenv/Tool-v0``,
``agentenv/Lookup-v0``) in the form each framework trains on.

One module per framework, each importing only its own framework's package (plus ``envs`` and ``agentenv``):
``skyrl`` (``skyrl_gym`` text envs), ``trl`` (``GRPOTrainer(environment_factory=...)`` environments) and
``verifiers`` (a ``verifiers.v1`` runtime on agentenv sandboxes, and tasksets rewarded by our grader). This
``__init__`` imports none of them, so ``import envs.frameworks`` needs no framework installed.
"""
