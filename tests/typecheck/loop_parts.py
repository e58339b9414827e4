"""Checked by mypy, never run: the real trainer and weight sync are what the training loop types its parts as
(``trainer.loop.parts.Steps`` and ``Pushes``, which the unit tests' fakes in tests/unit/trainer/loop_fakes.py also
satisfy)."""

from __future__ import annotations

from trainer.distributed.sync import WeightSync
from trainer.loop.parts import Pushes, Steps
from trainer.train import Trainer


def trainer(t: Trainer) -> Steps:
    return t


def weight_sync(s: WeightSync) -> Pushes:
    return s
