"""Checked by mypy, never run: the real trainer and weight sync are what the training loop types its parts as
(``trainer.parts.Steps`` and ``Pushes``, which the unit tests' fakes in tests/unit/trainer/loop_fakes.py also
satisfy)."""

from __future__ import annotations

from trainer.parts import Pushes, Steps
from trainer.sync import WeightSync
from trainer.train import Trainer


def trainer(t: Trainer) -> Steps:
    return t


def weight_sync(s: WeightSync) -> Pushes:
    return s
