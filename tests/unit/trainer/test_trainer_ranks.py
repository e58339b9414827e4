"""What ``Trainer(ranks=...)`` refuses before starting anything (the Ray ranks themselves train on a real Ray
cluster in tests/integration/rollout/test_trainer_ray_ranks.py)."""

import sys
from pathlib import Path

import pytest

from trainer.train import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import tiny_cfg  # noqa: E402


def test_trainer_ranks_refuse_what_they_do_not_do():
    with pytest.raises(ValueError, match="CPU"):
        Trainer(tiny_cfg(), TrainConfig(), world=2, ranks="ray", device="cuda")
    with pytest.raises(ValueError, match="ranks="):
        Trainer(tiny_cfg(), TrainConfig(), world=2, ranks="slurm")
