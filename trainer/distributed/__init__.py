"""Where the training runs: process groups and the EP x DP layout (``parallel``), one training rank and its ops
(``rank``, on ``policy.ranks``'s loop), ranks as Ray actors (``ray_ranks``), and the weight sync to the policy
servers (``sync``). It imports ``trainer.algorithm``, never ``trainer.loop`` (tests/unit/test_layout.py)."""
