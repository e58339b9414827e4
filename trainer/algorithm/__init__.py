"""The training maths, on trajectories and tensors only: GRPO advantages (``advantages``), the policy and SFT
losses (``losses``), trajectories into samples and micro-batches (``batch``), the router's balancing bias
(``balance``) and the RL health figures of a step (``health``). It imports nothing of ``trainer.distributed`` or
``trainer.loop`` (tests/unit/test_layout.py)."""
