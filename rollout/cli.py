"""``agentenv rollout ...``: play tasks with a policy on Ray workers, and look at the trajectories.

    agentenv rollout --env agentenv/SWE-v0 --tasks envs/tasks/swe_tasks.jsonl --policy-url URL \\
                     --policy-token-file policy.token --group-size 8 --workers 4 --out runs/NAME
    agentenv rollout show runs/NAME [--index N]
    agentenv rollout export runs/NAME --format parquet --schema verl --out NAME.parquet   # for other RL stacks
    agentenv rollout cleanup runs/NAME          # sandboxes a killed driver's run left behind
    agentenv rollout gateway --policy-url URL   # the LLM gateway for harnesses (rollout.gateway.cli)

The run shows a live progress bar (episodes, reward mean, generated tokens/s, environment vs policy time) and
ends with a summary table; the trajectories are msgpack shards in the out folder with ``run.json`` (the
settings) and ``summary.json`` (the figures).

Tokens come from a file (``--policy-token-file``, ``--env-token-file``) or the environment (``$AGENTENV_POLICY_TOKEN``,
``$AGENTENV_TOKEN``), never from the command line, which every local user reads (``ps``). What ``show`` prints of a
trajectory (tool output, task ids, errors) goes through ``agentenv.terminal``, and its turns are split at the
template's control tokens by id, never by text, so a tool output holding ``<|im_system|>`` stays one output.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agentenv.cli.shared import read_token
from agentenv.terminal import markup
from rollout.gateway import cli as gateway_cli
from rollout.trajectory import INFRA_ERRORS

app = typer.Typer(help="Rollouts: play tasks with a policy on Ray workers (GRPO groups forked from one state); "
                       "show the trajectories.", no_args_is_help=True, invoke_without_command=True)
console = Console()
app.add_typer(gateway_cli.app, name="gateway")


EnvTokenFile = Annotated[Path | None, typer.Option(
    exists=True, dir_okay=False, help="file holding the env servers' token (else $AGENTENV_TOKEN where it runs)")]


def _kv(items: list[str] | None, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{what} takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _env_urls(items: list[str] | None) -> dict[str, str] | None:
    """``URL`` (every node) or ``NODE=URL`` (a Ray node id or IP) -> the mapping the workers look up."""
    if not items:
        return None
    out = {}
    for item in items:
        node, sep, url = item.partition("=")
        if sep and not node.startswith(("http://", "https://")):
            out[node] = url
        else:
            out["*"] = item
    return out


def stats_line(stats: Any) -> str:
    reward = stats.reward_mean
    share = stats.env_share
    errors = sum(stats.finish.get(r, 0) for r in INFRA_ERRORS)
    parts = [f"reward {reward:.3f}" if reward is not None else "reward -",
             f"{stats.tokens_per_s:.1f} tok/s",
             f"env {share:.0%} / policy {1 - share:.0%}" if share is not None else "env - / policy -"]
    if errors:
        parts.append(f"[red]{errors} infra errors[/]")
    return " | ".join(parts)


def summary_table(summary: dict[str, Any]) -> Table:
    t = Table(title=f"rollout {markup(summary.get('run_id', ''))}", show_header=False)
    t.add_column("what", no_wrap=True)
    t.add_column("value")
    rm, rs = summary.get("reward_mean"), summary.get("reward_std")
    share = summary.get("env_share")
    rows = [
        ("groups / episodes", f"{summary['groups']} / {summary['episodes']}"),
        ("reward mean ± std", "-" if rm is None else f"{rm:.3f} ± {rs:.3f} ({summary['rewarded_episodes']} rewarded)"),
        ("finish reasons", markup(", ".join(f"{k} {v}" for k, v in sorted(summary["finish_reasons"].items())) or "-")),
        ("generated tokens", f"{summary['generated_tokens']} in {summary['turns']} turns"),
        ("throughput", f"{summary['episodes_per_min']:.1f} episodes/min, {summary['tokens_per_s']:.1f} tokens/s"),
        ("wall time", f"{summary['elapsed_s']:.1f} s"),
        ("time: policy", f"{summary['policy_s']:.1f} s"),
        ("time: env (reset, fork, steps)",
         f"{summary['reset_s']:.1f} + {summary['fork_s']:.1f} + {summary['env_step_s']:.1f} s"),
        ("env share of episode time", "-" if share is None else f"{share:.1%}"),
        ("retried episodes / worker failures", f"{summary['retried_episodes']} / {summary['worker_failures']}"),
    ]
    if summary.get("not_run_groups"):
        rows.append(("groups not played", f"[red]{summary['not_run_groups']}[/]"))
    for k, v in rows:
        t.add_row(k, v)
    return t


@app.callback(invoke_without_command=True)
def rollout(
    ctx: typer.Context,
    env: Annotated[str | None, typer.Option(help="env id, e.g. agentenv/SWE-v0 or agentenv/Tool-v0")] = None,
    tasks: Annotated[Path | None, typer.Option(help="task records (JSONL, or a JSON list)")] = None,
    task: Annotated[list[str] | None, typer.Option(help="a task id (repeatable); instead of --tasks")] = None,
    limit: Annotated[int | None, typer.Option(help="play the first N tasks (without tasks: N draws of the env)")] = None,
    policy_url: Annotated[str | None, typer.Option(help="OpenAI-compatible policy endpoint")] = None,
    policy_token_file: Annotated[Path | None, typer.Option(
        exists=True, dir_okay=False, help="file holding its bearer token (else $AGENTENV_POLICY_TOKEN)")] = None,
    model: Annotated[str | None, typer.Option(help="model name (default: the first the endpoint lists)")] = None,
    group_size: Annotated[int, typer.Option(help="episodes per task, forked from one reset (GRPO group)")] = 1,
    workers: Annotated[int, typer.Option(help="Ray rollout workers (0: in this process, no Ray)")] = 1,
    out: Annotated[Path | None, typer.Option(help="run folder (default runs/<run id>)")] = None,
    ray_address: Annotated[str | None, typer.Option(help="join this Ray cluster (default: start one here)")] = None,
    env_url: Annotated[list[str] | None, typer.Option(
        help="agentenv serve for the workers' sandboxes: URL, or NODE=URL per Ray node id/IP (repeatable); "
             "default: $AGENTENV_URL on each node, else local sandboxes")] = None,
    env_token_file: EnvTokenFile = None,
    env_fleet: Annotated[bool, typer.Option(help="each worker uses its node's server of the Ray cluster's fleet "
                                                 "(agentenv cluster up)")] = False,
    env_arg: Annotated[list[str] | None, typer.Option(help="KEY=VALUE passed to gymnasium.make (JSON values)")] = None,
    memory_fork: Annotated[bool, typer.Option(help="fork processes too (CRIU), not only files")] = False,
    max_turns: Annotated[int, typer.Option(help="policy calls per episode")] = 30,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per policy call")] = 512,
    max_total_tokens: Annotated[int, typer.Option(help="generated tokens per episode")] = 8192,
    context_limit: Annotated[int, typer.Option(help="prompt + generated tokens")] = 32768,
    temperature: Annotated[float, typer.Option(help="sampling temperature")] = 1.0,
    retries: Annotated[int, typer.Option(help="plays again of an episode that hit an infrastructure error")] = 2,
    groups_per_worker: Annotated[int, typer.Option(help="groups in flight per worker (backpressure)")] = 4,
    worker_cpus: Annotated[float, typer.Option(help="CPUs Ray reserves per worker")] = 0.5,
    seed: Annotated[int, typer.Option(help="group i resets with seed + i")] = 0,
    keep_messages: Annotated[bool, typer.Option(help="store each conversation as messages too")] = False,
    verify: Annotated[bool, typer.Option(help="check the policy endpoint (agentenv policy verify) first")] = False,
    harness: Annotated[str | None, typer.Option(help="play episodes with this agent harness through the LLM "
                                                     "gateway (mini-swe-agent) instead of the agent loop")] = None,
    harness_arg: Annotated[list[str] | None, typer.Option(help="KEY=VALUE of the harness's own agent config "
                                                               "(JSON values), e.g. step_limit=20")] = None,
) -> None:
    """Play tasks with a policy and write their trajectories (see ``agentenv rollout --help``)."""
    if ctx.invoked_subcommand is not None:
        return
    if env is None or policy_url is None:
        console.print("[red]error:[/] --env and --policy-url are needed (or a command: show, cleanup)")
        raise typer.Exit(2)
    from agentenv.errors import AgentEnvError
    from rollout.agent import AgentConfig
    from rollout.driver import Rollout
    from rollout.workers import RolloutConfig, RolloutError, load_task_refs

    token = read_token(policy_token_file, "AGENTENV_POLICY_TOKEN")
    refs: list[Any]
    if tasks is not None:
        refs = load_task_refs(tasks)
        if task:
            wanted = set(task)
            refs = [r for r in refs if str(r.get("instance_id") or r.get("id")) in wanted]
    elif task:
        refs = list(task)
    elif limit is not None:
        refs = [None] * limit
    else:
        console.print("[red]error:[/] give --tasks FILE, --task ID or --limit N (draws of the env)")
        raise typer.Exit(2)
    if limit is not None:
        refs = refs[:limit]
    if verify and not _verify(policy_url, token, model):
        raise typer.Exit(1)
    agent = AgentConfig(max_turns=max_turns, max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens,
                        context_limit=context_limit, temperature=temperature)
    try:
        from rollout.harnesses import HarnessConfig

        driver = None if harness is None else HarnessConfig.for_loop(harness, _kv(harness_arg, "--harness-arg"), agent)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    cfg = RolloutConfig(env, policy_url, policy_token=token, policy_model=model, group_size=group_size,
                        memory_fork=memory_fork, agent=agent, env_kwargs=_kv(env_arg, "--env-arg"), harness=driver,
                        env_urls=_env_urls(env_url), env_token=read_token(env_token_file, None),
                        env_fleet=env_fleet, max_retries=retries,
                        groups_per_worker=groups_per_worker, worker_cpus=worker_cpus, seed=seed,
                        keep_messages=keep_messages)
    run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    folder = out or Path("runs") / run_id
    r = Rollout(cfg, workers=workers, out=folder, ray_address=ray_address, run_id=run_id)
    code = 0
    console.print(f"rollout {r.run_id}: {len(refs)} groups of {group_size} on {markup(env)}, {workers} workers -> "
                  f"{markup(folder)}")
    progress = Progress(TextColumn("episodes"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[stats]}"), console=console)
    try:
        with progress:
            bar = progress.add_task("episodes", total=len(refs) * group_size, stats="starting workers ...")
            for result in r.groups(refs):
                progress.update(bar, advance=len(result.trajectories), stats=stats_line(r.stats))
    except (RolloutError, AgentEnvError) as e:
        console.print(f"[red]error:[/] {markup(e)}")
        code = 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: the trajectories so far are kept")
        code = 130
    finally:
        r.close()
    console.print(summary_table(r.summary()))
    console.print(f"trajectories: {markup(folder)} (agentenv rollout show {markup(folder)})")
    if code:
        raise typer.Exit(code)


def _verify(url: str, token: str | None, model: str | None) -> bool:
    try:
        from policy.verify import print_report
        from policy.verify import verify as run_verify
    except ImportError as e:
        console.print(f"[yellow]--verify skipped: {e}[/]")
        return True
    report = asyncio.run(run_verify(url, token, model))
    print_report(report)
    return bool(report.ok)


# --- show ------------------------------------------------------------------------------------------------

def split_messages(ids: list[int], tokenizer: Any = None) -> list[tuple[str, str]]:
    """(name, body) of each K3 message in ``ids`` (``tool_declare`` included), split at the template's control
    tokens by id: a control string inside a tool output's text stays part of that output. ``tokenizer``: one with
    ``decode_pieces`` (``rollout.agent.Tokenizer``; default k3-mini's)."""
    from policy import chat

    if tokenizer is None:
        tokenizer = _local_tokenizer()
    return chat.messages_of(tokenizer.decode_pieces(ids))


@functools.cache
def _local_tokenizer() -> Any:
    from rollout.agent import LocalTokenizer

    return LocalTokenizer()


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2] + f"\n… [{len(text) - n} characters cut] …\n" + text[-n // 2:]


def _tool_calls(text: str) -> tuple[str, list[str]]:
    from policy import chat

    msg = chat.parse_assistant(text)
    calls = []
    for c in msg.tool_calls:
        args = c["function"]["arguments"]
        with contextlib.suppress(ValueError):
            args = json.dumps(json.loads(args), ensure_ascii=False)
        calls.append(f"{c['function']['name']}({args})")
    content = msg.content if not msg.malformed else text
    if msg.reasoning_content:
        content = f"<think>{msg.reasoning_content}</think>{content}"
    return content, calls


def render_trajectory(t: Any, tokenizer: Any, width: int = 1500) -> list[str]:
    """Lines (rich markup) that show one trajectory: the task, each turn's text, tool calls and outputs, timings.
    Every text of the record is printed through ``agentenv.terminal.markup`` (a record is data, maybe hostile)."""
    gen = sum(x.generated for x in t.turns)
    policy_s, env_s = sum(x.policy_s for x in t.turns), sum(x.env_s for x in t.turns)
    reset_s = float(t.metadata.get("reset_s") or 0.0)
    lines = [f"[bold]{markup(t.task_id or '?')}[/] on {markup(t.env_id or '?')}  group {markup(t.group_id)}"
             f" #{t.group_index}  episode {markup(t.episode_id)}",
             f"reward [bold]{markup(t.reward)}[/]  finish [bold]{markup(t.finish_reason)}[/]  turns {len(t.turns)}  "
             f"tokens {len(t.token_ids)} ({gen} generated, prompt {t.prompt_len})  tool calls {t.tool_calls}"
             f" (malformed {t.malformed_calls})",
             f"time: policy {policy_s:.2f} s, env steps {env_s:.2f} s, group reset {reset_s:.2f} s, fork "
             f"{t.fork_s:.2f} s"]
    if t.error:
        lines.append(f"[red]error:[/] {markup(t.error)}")
    if t.grade:
        lines.append(f"grade: {markup(json.dumps(t.grade)[:400])}")
    for name, body in split_messages(t.token_ids[: t.prompt_len], tokenizer):
        if name != "tool_declare" and body.strip():
            lines.append(f"[cyan]── {markup(name)}[/]\n{markup(_clip(body, width))}")
    starts = [x.start for x in t.turns] + [len(t.token_ids)]
    for i, turn in enumerate(t.turns):
        text = tokenizer.decode(t.token_ids[turn.start: turn.start + turn.generated])
        text = text.removesuffix("<|im_end|>")
        content, calls = _tool_calls(text)
        lines.append(f"[green]── turn {i + 1}[/]  policy {turn.policy_s:.2f} s, env {turn.env_s:.2f} s, "
                     f"{turn.generated} tokens, weights v{turn.weight_version}"
                     + (f", finish {markup(turn.finish)}" if turn.finish else "")
                     + (" [red]malformed[/]" if turn.malformed else ""))
        if content.strip():
            lines.append(markup(_clip(content.strip(), width)))
        for c in calls:
            lines.append(f"[yellow]→ {markup(_clip(c, width))}[/]")
        for name, body in split_messages(t.token_ids[turn.start + turn.generated: starts[i + 1]], tokenizer):
            if name == "assistant":
                continue
            lines.append(f"[magenta]← {markup(name)}[/]\n{markup(_clip(body, width))}")
    return lines


@app.command()
def show(
    file: Annotated[Path, typer.Argument(help="a run folder or one shard")],
    index: Annotated[int, typer.Option(help="which trajectory (0-based, in shard order)")] = 0,
    width: Annotated[int, typer.Option(help="characters shown of each text before cutting the middle")] = 1500,
) -> None:
    """Print one trajectory readably: turns, tool calls, outputs, reward, where the time went."""
    from rollout import trajectory

    try:
        found = next((t for i, t in enumerate(trajectory.read(file)) if i == index), None)
    except trajectory.TrajectoryError as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise typer.Exit(1) from None
    if found is None:
        console.print(f"[red]error:[/] {markup(file)} holds no trajectory {index}")
        raise typer.Exit(1)
    for line in render_trajectory(found, _local_tokenizer(), width):
        console.print(line, highlight=False)


@app.command()
def cleanup(
    run: Annotated[str, typer.Argument(help="a run folder (its run.json names the run) or a run id")],
    env_url: Annotated[list[str] | None, typer.Option(help="env servers the run used (repeatable)")] = None,
    env_token_file: EnvTokenFile = None,
) -> None:
    """Close the sandboxes and delete the snapshots a run left behind (after its driver was killed)."""
    from rollout.ownership import sweep_run

    swept = sweep_run(run, env_url or [], read_token(env_token_file, None))
    console.print(f"closed {len(swept['sandboxes'])} sandboxes, deleted {len(swept['snapshots'])} snapshots")


class ExportFormat(StrEnum):
    jsonl = "jsonl"
    parquet = "parquet"


class ExportSchema(StrEnum):
    neutral = "neutral"
    verl = "verl"
    trl = "trl"
    slime = "slime"


@app.command("export")
def export_cmd(
    run: Annotated[Path, typer.Argument(help="a rollout run folder, a train run (its trajectories/), or one shard")],
    out: Annotated[Path, typer.Option(help="the file to write")],
    fmt: Annotated[ExportFormat, typer.Option("--format", help="jsonl or parquet")] = ExportFormat.jsonl,
    schema: Annotated[ExportSchema, typer.Option(help="column names for this reader (docs/rollouts.md)")
                      ] = ExportSchema.neutral,
    text: Annotated[bool, typer.Option(help="add the prompt and response as text (k3-mini's tokenizer)")] = False,
    keep_errors: Annotated[bool, typer.Option(help="keep env_error / policy_error episodes (null reward)")] = False,
) -> None:
    """Write a run's trajectories (prompt / response ids, loss mask, logprobs, reward) for verl, TRL or slime."""
    from rollout import export, trajectory

    decode = None
    if text:
        decode = _local_tokenizer().decode
    try:
        done = export.export(run, out, fmt.value, schema.value, decode=decode, keep_errors=keep_errors)
    except (export.ExportError, trajectory.TrajectoryError) as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise typer.Exit(1) from None
    left = f", {done['skipped_infra_errors']} infrastructure-error episodes left out" \
        if done["skipped_infra_errors"] else ""
    console.print(f"{done['rows']} trajectories -> {markup(out)} ({fmt.value}, {schema.value} schema{left})")
