"""SFT warm start: supervised fine-tuning on demonstration trajectories, in the same trajectory format.

The loss is the negative log-likelihood of the tokens the demonstrator generated (``loss_mask`` 1), averaged over
those tokens (token mean over the whole batch, like the policy loss):

    loss = - sum_t m_t * log pi_theta(y_t | y_<t) / sum_t m_t

Prompts, templates and tool outputs (mask 0) are context only. ``run_sft`` is a complete, resumable run: the data
order is a seeded permutation per epoch, and the position in it (epoch, index) is checkpointed with the model, so a
run killed at any point and resumed takes exactly the steps, on exactly the batches, that an uninterrupted run takes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.batch import Batch, Sample
from trainer.losses import token_mean
from trainer.metrics import MetricsLog, Progress, TensorBoard, plot

if TYPE_CHECKING:
    from trainer.train import Trainer


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Masked NLL: the token mean of -log p over the mask (``denom``: the batch's token count)."""
    return -token_mean(logp, mask, denom)


def sft_samples(trajectories: Sequence[Any], min_reward: float | None = None) -> list[Sample]:
    """Demonstrations as samples: infrastructure failures left out, and (with ``min_reward``) episodes that scored
    less; samples without a generated token after the first position are skipped."""
    out = []
    for t in trajectories:
        if t.reward is None or getattr(t, "infra_error", False):
            continue
        if min_reward is not None and t.reward < min_reward:
            continue
        s = Sample.from_trajectory(t)
        if s.loss_tokens:
            out.append(s)
    return out


@dataclass
class DataCursor:
    """A position in an endless stream of epochs, each a seeded permutation of ``n`` items."""

    n: int
    seed: int = 0
    epoch: int = 0
    index: int = 0

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        """The next ``k`` items (crossing into the next epoch when this one runs out)."""
        if self.n == 0:
            raise ValueError("no data")
        out: list[int] = []
        while len(out) < k:
            order = self.order(self.epoch)
            need = k - len(out)
            out += order[self.index:self.index + need]
            self.index += need
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "index": self.index}

    def load(self, state: dict[str, Any]) -> None:
        if state.get("n", self.n) != self.n:
            raise ValueError(f"the checkpoint's data has {state['n']} items, this run has {self.n}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def run_sft(trainer: Trainer, samples: Sequence[Sample], *, steps: int, batch_size: int,
            out: str | os.PathLike[str], ckpt_every: int = 1, keep: int = 2, resume: bool = True, seed: int = 0,
            progress: bool | None = None, plot_every: int = 10, tensorboard: bool = False) -> list[dict[str, Any]]:
    """Train ``steps`` SFT steps of ``batch_size`` samples; under ``out``: ``checkpoints/``, ``metrics.jsonl``,
    ``metrics.png`` (and ``tensorboard/``). With ``resume``, continue from the newest checkpoint. Returns the
    metrics rows of the steps this call ran."""
    out = Path(out)
    ckpt_dir = out / "checkpoints"
    cursor = DataCursor(len(samples), seed)
    meta = trainer.resume(ckpt_dir) if resume else None
    if meta is not None:
        cursor.load(meta["data"])
    log = MetricsLog(out / "metrics.jsonl", resume_step=trainer.step_count if meta is not None else None)
    tb = TensorBoard(out / "tensorboard" if tensorboard else None)
    rows = []
    with Progress(steps, "SFT", enabled=progress) as bar:
        bar.update(trainer.step_count, {})
        while trainer.step_count < steps:
            position = cursor.state()
            batch = Batch([samples[i] for i in cursor.take(batch_size)], "sft")
            m = trainer.step(batch)
            step = trainer.step_count
            m.update({"data/epoch": float(position["epoch"]), "data/index": float(position["index"])})
            rows.append(log.write(step, m))
            tb.write(step, m)
            if ckpt_every > 0 and (step % ckpt_every == 0 or step == steps):
                trainer.checkpoint(ckpt_dir, cursor.state(), keep=keep)
            if plot_every > 0 and (step % plot_every == 0 or step == steps):
                plot(log.rows(), out / "metrics.png", title="SFT")
            bar.update(step, m)
    tb.close()
    return rows
