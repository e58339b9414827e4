"""``agentenv train`` (also ``python -m trainer``): the whole RL loop from a TOML config, the SFT warm start from
demonstration trajectories, and plots of a metrics log.

    agentenv train --config trainer/configs/main.toml [--quick] [--seed N] [--name NAME] [--set rl.iterations=4]
                   [--policy-url URL --policy-token-file F] [--ray-address HOST:PORT] [--resume] [--dry-run]
    agentenv train defaults                      # every key with its default and documentation, as TOML
    agentenv train sft --data runs/demos --out runs/sft --steps 200 --batch-size 16 [--ep 2 --world 2] [--resume]
    agentenv train plot runs/sft/metrics.jsonl

``agentenv train --config FILE`` starts what is missing — the policy server (``agentenv policy serve --ep 2``), a
local Ray with rollout workers, the trainer — runs the loop of ``trainer/loop/core.py`` and stops what it started;
``--policy-url`` / ``--ray-address`` use existing ones instead. A pre-flight checks every part before anything
starts. ``--dry-run`` prints the plan and the effective configuration and starts nothing.

``sft`` writes ``OUT/checkpoints/`` (every ``--ckpt-every`` steps), ``OUT/metrics.jsonl``, ``OUT/metrics.png`` and,
at the end, ``OUT/weights``: a Kimi checkpoint folder (policy/hf_format.py) that ``agentenv policy serve --weights``,
``/update_weights``, mlx-lm's ``kimi_k3`` and transformers' ``kimi_linear`` load.
Killed at any point (``kill -9`` included), the same command with ``--resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="Training: the RL loop (agentenv train --config FILE), SFT warm start, plots.",
                  no_args_is_help=True, invoke_without_command=True)


def _free_name(out_dir: Path, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``, ... when a run folder of that name already holds something."""
    if not (out_dir / name).exists() or not any((out_dir / name).iterdir()):
        return name
    i = 2
    while (out_dir / f"{name}-{i}").exists():
        i += 1
    return f"{name}-{i}"


@app.callback(invoke_without_command=True)
def train(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="TOML config (every key has a default: agentenv train "
                                                     "defaults)")] = None,
    quick: Annotated[bool, typer.Option(help="lay trainer/configs/quick.toml over it: a few minutes, end to "
                                             "end (CI)")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="section.key=value (TOML value), repeatable")] = None,
    name: Annotated[str | None, typer.Option(help="run name: the folder out_dir/NAME")] = None,
    seed: Annotated[int | None, typer.Option(help="seed of weights, tasks and sampling")] = None,
    policy_url: Annotated[str | None, typer.Option(help="use this policy endpoint instead of starting one")] = None,
    policy_token_file: Annotated[Path | None, typer.Option(help="file holding its bearer token (else "
                                                                 "$AGENTENV_POLICY_TOKEN)")] = None,
    ray_address: Annotated[str | None, typer.Option(help="use this Ray cluster instead of a local Ray")] = None,
    resume: Annotated[bool, typer.Option(help="continue the run of this name from its newest checkpoint")] = False,
    dry_run: Annotated[bool, typer.Option(help="print the plan and the effective configuration; start "
                                               "nothing")] = False,
) -> None:
    """Run the RL loop: SFT warm start, GRPO with groups forked from one state, held-out evaluation, one SWE
    iteration; progress live, a summary at the end, everything in out_dir/name."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console

    from agentenv.terminal import clean, markup
    from trainer.loop.config import ConfigError, describe, load
    from trainer.loop.core import Loop
    from trainer.loop.services import PreflightError, ServerError, preflight

    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    overrides = list(set_ or [])
    for key, value in (("name", name), ("seed", seed), ("policy.url", policy_url),
                       ("policy.token_file", policy_token_file), ("ray.address", ray_address)):
        if value is not None:
            overrides.append(f"{key}={json.dumps(str(value) if isinstance(value, Path) else value)}")
    try:
        cfg = load(config, quick=quick, overrides=overrides)
    except ConfigError as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise typer.Exit(2) from None
    if resume:
        if not (cfg.run_dir / "checkpoints").is_dir() and not (cfg.run_dir / "sft").is_dir():
            console.print(f"[red]error:[/] nothing to resume in {markup(cfg.run_dir)}")
            raise typer.Exit(2)
    else:
        free = _free_name(Path(cfg.out_dir), cfg.name)
        if free != cfg.name:
            console.print(f"{cfg.run_dir} already holds a run: this one goes to {Path(cfg.out_dir) / free} "
                          f"(--resume continues {cfg.run_dir})")
            cfg.name = free
    loop = Loop(cfg, resume=resume, console=console)
    if dry_run:
        print(loop.plan())
        try:
            checked = preflight(cfg, resume=resume, build=False)
            print(f"pre-flight: {', '.join(checked)} ok")
        except PreflightError as e:
            print(clean(str(e)))
        print("\n# the effective configuration (`agentenv train defaults` lists every key)\n")
        print(describe(cfg), end="")
        return
    console.print(f"[bold]agentenv train[/] {markup(cfg.name)}: {markup(loop.plan().splitlines()[0])}")

    def _terminate(signum: int, frame: Any) -> None:   # SIGTERM as Ctrl-C: stop what was started, keep checkpoints
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    loop.on_sigterm = _terminate
    try:
        loop.run()
    except (PreflightError, ServerError) as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise typer.Exit(1) from None
    except (RuntimeError, OSError, ValueError) as e:   # a part failed mid-run (sync, a trainer rank, the workers)
        console.print(f"[red]error:[/] {type(e).__name__}: {markup(e)}\nwhat the run wrote is in {cfg.run_dir}; "
                      f"the same command with `--resume --name {cfg.name}` continues from its last checkpoint")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]: the same command with `--resume --name {cfg.name}` continues from "
                      "the last checkpoint")
        raise typer.Exit(130) from None


@app.command("defaults")
def defaults_cmd() -> None:
    """Print every configuration key with its default and documentation, as TOML."""
    from trainer.loop.config import defaults_toml
    print(defaults_toml(), end="")


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
    init_weights: Annotated[str | None, typer.Option(help="weights to start from: a Kimi checkpoint folder or a .safetensors file (default: seed init)")] = None,
    world: Annotated[int, typer.Option(help="training ranks (processes)")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="expert-parallel ranks per group (divides --world)")] = 1,
    device: Annotated[str, typer.Option(help="cpu, or cuda (one GPU per rank, NCCL)")] = "cpu",
    dtype: Annotated[str, typer.Option(help="parameter dtype")] = "float32",
    seed: Annotated[int, typer.Option(help="initial weights and data order")] = 0,
    min_reward: Annotated[float | None, typer.Option(help="keep demonstrations scoring at least this")] = None,
    ckpt_every: Annotated[int, typer.Option(help="checkpoint every N steps (0: only at the end)")] = 1,
    resume: Annotated[bool, typer.Option(help="continue from the newest checkpoint under OUT")] = False,
    progress: Annotated[bool | None, typer.Option(help="live display (default: when on a terminal)")] = None,
    tracker: Annotated[str, typer.Option(help="also log to wandb (offline), tensorboard or mlflow (trainer.trackers)")]
    = "",
) -> None:
    """Supervised warm start on demonstrations: masked NLL over the generated tokens."""
    from policy.config import model_config
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
                resume=resume, seed=seed, progress=progress, tracker=tracker)
        trainer.save_weights(out / "weights")
    print(f"weights: {out / 'weights'}  metrics: {out / 'metrics.jsonl'}")


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
