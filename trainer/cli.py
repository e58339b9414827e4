"""``python -m trainer ...``: the SFT warm start from demonstration trajectories, and plots of a metrics log.

    python -m trainer sft --data runs/demos --out runs/sft --steps 200 --batch-size 16 [--ep 2 --world 2] [--resume]
    python -m trainer plot runs/sft/metrics.jsonl

``sft`` writes ``OUT/checkpoints/`` (every ``--ckpt-every`` steps), ``OUT/metrics.jsonl``, ``OUT/metrics.png`` and,
at the end, ``OUT/weights.safetensors`` (what ``agentenv policy serve --weights`` or ``/update_weights`` load).
Killed at any point (``kill -9`` included), the same command with ``--resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="Training: SFT warm start, GRPO on trajectories, weight sync, checkpoints.",
                  no_args_is_help=True)


def model_config(preset: str = "k3-mini", config_file: Path | None = None) -> Any:
    """The model configuration the policy server uses for ``preset`` (the tokenizer's vocabulary and special ids),
    or the one a JSON file describes (``K3Config`` fields)."""
    from policy.config import K3Config
    from policy.config import preset as get_preset
    if config_file is not None:
        return K3Config.from_dict(json.loads(config_file.read_text()))
    from policy.tokenizer import load_tokenizer
    tok = load_tokenizer()
    return get_preset(preset, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                      pad_token_id=tok.pad_id)


@app.command()
def sft(
    data: Annotated[Path, typer.Option(help="run folder (or shard) of demonstration trajectories")],
    out: Annotated[Path, typer.Option(help="output folder: checkpoints, metrics, final weights")],
    steps: Annotated[int, typer.Option(help="optimizer steps in total")] = 100,
    batch_size: Annotated[int, typer.Option(help="episodes per step")] = 8,
    lr: Annotated[float, typer.Option(help="AdamW learning rate")] = 1e-4,
    warmup_steps: Annotated[int, typer.Option(help="linear learning-rate warm-up")] = 0,
    micro_batch_tokens: Annotated[int, typer.Option(help="padded tokens per forward/backward")] = 4096,
    preset: Annotated[str, typer.Option(help="model preset (as the policy server's)")] = "k3-mini",
    model_config_file: Annotated[Path | None, typer.Option("--model-config", help="JSON of K3Config fields")] = None,
    init_weights: Annotated[str | None, typer.Option(help="safetensors to start from (default: seed init)")] = None,
    world: Annotated[int, typer.Option(help="training ranks (processes)")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="expert-parallel ranks per group (divides --world)")] = 1,
    device: Annotated[str, typer.Option(help="cpu, or cuda (one GPU per rank, NCCL)")] = "cpu",
    dtype: Annotated[str, typer.Option(help="parameter dtype")] = "float32",
    seed: Annotated[int, typer.Option(help="initial weights and data order")] = 0,
    min_reward: Annotated[float | None, typer.Option(help="keep demonstrations scoring at least this")] = None,
    ckpt_every: Annotated[int, typer.Option(help="checkpoint every N steps (0: only at the end)")] = 1,
    resume: Annotated[bool, typer.Option(help="continue from the newest checkpoint under OUT")] = False,
    progress: Annotated[bool | None, typer.Option(help="live display (default: when on a terminal)")] = None,
    tensorboard: Annotated[bool, typer.Option(help="also write TensorBoard events (needs tensorboard)")] = False,
) -> None:
    """Supervised warm start on demonstrations: masked NLL over the generated tokens."""
    from rollout.trajectory import read
    from trainer.sft import run_sft, sft_samples
    from trainer.train import TrainConfig, Trainer

    samples = sft_samples(list(read(data)), min_reward)
    if not samples:
        print(f"error: no usable demonstration in {data}", file=sys.stderr)
        raise typer.Exit(2)
    cfg = TrainConfig(lr=lr, warmup_steps=warmup_steps, micro_batch_tokens=micro_batch_tokens, seed=seed, dtype=dtype)
    if not resume and (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        print(f"error: {out} holds checkpoints; pass --resume to continue them or choose another --out",
              file=sys.stderr)
        raise typer.Exit(2)
    with Trainer(model_config(preset, model_config_file), cfg, world=world, ep_size=ep, weights=init_weights,
                 device=device) as trainer:
        run_sft(trainer, samples, steps=steps, batch_size=batch_size, out=out, ckpt_every=ckpt_every,
                resume=resume, seed=seed, progress=progress, tensorboard=tensorboard)
        trainer.save_weights(out / "weights.safetensors")
    print(f"weights: {out / 'weights.safetensors'}  metrics: {out / 'metrics.jsonl'}")


@app.command("plot")
def plot_cmd(
    metrics: Annotated[Path, typer.Argument(help="metrics JSONL")],
    out: Annotated[Path | None, typer.Option(help="PNG (default: next to the JSONL)")] = None,
) -> None:
    """Draw the standard panels of a metrics log as one PNG."""
    from trainer.metrics import plot
    path = plot(metrics, out or metrics.with_suffix(".png"), title=metrics.parent.name)
    print(path or "nothing to plot")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
