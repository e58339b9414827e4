"""Environment adapters for RL frameworks: agentenv's Gymnasium envs (``agentenv/SWE-v0``, ``agentenv/Tool-v0``,
``agentenv/Lookup-v0``) in the form each framework trains on.

One module per framework, each importing only its own framework's package (plus ``envs`` and ``agentenv``):
``skyrl`` (``skyrl_gym`` text envs), ``trl`` (``GRPOTrainer(environment_factory=...)`` environments),
``verifiers`` (a ``verifiers.v1`` runtime on agentenv sandboxes, and tasksets rewarded by our grader), ``verl``
(agent loops owning one sandbox per episode) and ``openrlhf`` (agent instances owning one sandbox per prompt). This
``__init__`` imports none of them, so ``import envs.frameworks`` needs no framework installed.

verl 0.9.1 (the release with ``AgentLoopBase``) does not install beside this project's pins: it needs
transformers<5.11, hence huggingface-hub<2 (the venv has 2.4, and TRL 1.16 brings transformers 5.25); verl 0.5-0.8
need numpy<2. OpenRLHF 0.11.2 pins transformers==5.15.0, ray==2.55.0, deepspeed==0.19.6 and flash-attn==2.8.3 (whose
build needs torch and CUDA). Both run from a side venv on the path (docs/integrations/verl.md, openrlhf.md).
"""
