"""The configuration of ``agentenv train``: TOML, every key with a documented default.

A run's settings are layered: the defaults below ← ``--config FILE`` ← ``--quick`` (``trainer/configs/quick.toml``
laid over it) ← ``--set section.key=value``. Unknown sections and keys are refused with their name (a typo never
silently falls back to a default), and so are values of the wrong type. ``describe(cfg)`` renders the effective
configuration as TOML with each key's documentation as a comment (``agentenv train --dry-run`` prints it);
``defaults_toml()`` is the same for the defaults.

Sections: ``[policy]`` (the policy server: started here, or an existing one), ``[ray]`` (rollout workers),
``[env]`` (the task family, its train / held-out tasks, the agent loop's limits), ``[sft]`` (the warm start),
``[rl]`` (GRPO: groups, staleness, partial rollouts, the loss), ``[trainer]`` (training processes), ``[eval]``
(held-out evaluation), ``[swe]`` (one iteration over SWE-v0 tasks through the same path).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.loop import typed_toml
from trainer.loop.typed_toml import ConfigError, doc, merge, parse_override, read_toml, render

CONFIGS = Path(__file__).parents[1] / "configs"
MAIN_TOML, QUICK_TOML = CONFIGS / "main.toml", CONFIGS / "quick.toml"


@dataclass
class PolicyConfig:
    """The policy server the rollouts ask and the trainer's weights go to."""

    url: str = doc("", "an existing OpenAI-compatible endpoint (ours, vLLM, SGLang); empty: start "
                       "`agentenv policy serve` here (also --policy-url)")
    token_file: str = doc("", "file holding that endpoint's bearer token (else $AGENTENV_POLICY_TOKEN; a server "
                              "started here gets a fresh token in the run folder)")
    kind: str = doc("agentenv", "how the endpoint reloads weights: agentenv (/update_weights), sglang "
                                "(/update_weights_from_disk), vllm (dev mode: /pause, /collective_rpc "
                                "reload_weights, /update_weight_version, /resume)")
    model: str = doc("", "model name to ask for (empty: the first the endpoint lists)")
    preset: str = doc("k3-mini", "model preset of a server started here (and of the trainer)")
    ep: int = doc(2, "expert-parallel ranks (processes) of a server started here")
    port: int = doc(0, "port of a server started here (0: a free one)")
    max_context: int = doc(4096, "context length of a server started here (prompt + completion tokens)")
    max_batch: int = doc(32, "most sequences in the running batch of a server started here")
    verify: str = doc("quick", "pre-flight of the endpoint: quick (models, token ids + logprobs, weight version), "
                               "full (agentenv policy verify), off")
    startup_timeout_s: float = doc(300.0, "seconds to wait for a server started here to answer /health")
    sync_mode: str = doc("drain", "weight update: drain (running generations finish on the old weights) or abort")


@dataclass
class RayConfig:
    """Rollout workers: a local Ray started here, or an existing cluster."""

    address: str = doc("", "an existing Ray cluster (host:port; also --ray-address); empty: a local Ray")
    workers: int = doc(1, "Ray rollout workers (0: play in this process, without Ray)")
    worker_cpus: float = doc(0.5, "CPUs Ray reserves per worker")
    groups_per_worker: int = doc(32, "groups in flight per worker (backpressure)")
    env_url: str = doc("", "agentenv serve URL the workers make sandboxes on (empty: $AGENTENV_URL, else local)")
    env_fleet: bool = doc(False, "each worker uses its node's server of the cluster's fleet (agentenv cluster up); "
                                 "token: $AGENTENV_TOKEN")
    memory_fork: bool = doc(False, "fork processes too (CRIU) when a group forks, not only files")


@dataclass
class EnvConfig:
    """The task family: the env, its training and held-out tasks, the agent loop's limits."""

    id: str = doc("agentenv/Tool-v0", "Gymnasium env id (registered by `import envs`)")
    kwargs: dict[str, Any] = doc({}, "keyword arguments of gymnasium.make(id, ...)")
    train_tasks: str = doc("py:envs.tool_env:task_ids split=train",
                           "training tasks: ids:ID,ID,... , py:MODULE:FUNCTION key=value ... (a function that "
                           "lists task ids or records; values in TOML without spaces, e.g. levels=[1,2]), a JSONL / "
                           "JSON file of task records, or seeds:A-B (the env draws a task from each seed; with "
                           "evaluation on, refused: the pre-flight cannot check such a set against the held-out one)")
    heldout_tasks: str = doc("py:envs.tool_env:task_ids split=heldout",
                             "held-out tasks, never trained on, read only for the reported figures (same forms); "
                             "the pre-flight refuses a run whose held-out, validation and training tasks share a "
                             "task (by the env module's task_key, else by task id)")
    validation_tasks: str = doc("py:envs.tool_env:task_ids split=validation",
                                "validation tasks, for choosing recipes: the evaluations during RL (eval.every) "
                                "read these, never the held-out ones (empty: none)")
    max_turns: int = doc(4, "policy calls per episode")
    max_new_tokens: int = doc(64, "tokens per policy call")
    max_total_tokens: int = doc(256, "generated tokens per episode")
    context_limit: int = doc(4096, "prompt + generated tokens per episode")
    temperature: float = doc(1.0, "sampling temperature of training rollouts")
    top_p: float = doc(1.0, "nucleus sampling of training rollouts: only 1.0 is accepted, since the trainer scores "
                            "tokens under the full temperature-scaled distribution, not the truncated one the engine "
                            "would sample from (evaluation samples with top_p 1 too)")
    system_prompt: str = doc("", "a system message before each task (empty: none)")
    harness: str = doc("", "an agent harness that plays every episode, unmodified, through the LLM gateway "
                           "instead of the agent loop (mini-swe-agent; empty: the agent loop); the limits above "
                           "become its sessions' budgets (docs/harnesses.md)")
    harness_agent: dict[str, Any] = doc({}, "the harness's own agent settings over its defaults (mini-swe-agent: "
                                            "step_limit, system_template, instance_template, ...)")
    harness_timeout_s: float = doc(1800.0, "seconds a harness episode may run before it ends as a timeout")


@dataclass
class SFTConfig:
    """The warm start: supervised fine-tuning on scripted demonstrations played through the real env path."""

    enabled: bool = doc(True, "run the warm start (off: RL starts from --init-weights or the seed's weights)")
    expert: str = doc("rollout.experts:write_demonstrations", "module:function(env_id, tasks, out, n[, env_kwargs=]) "
                                                                "that plays a scripted expert and writes trajectory "
                                                                "shards (env_kwargs: env.kwargs, when set)")
    expert_kwargs: dict[str, Any] = doc({}, "more keyword arguments of the expert function (e.g. guess = 0.5 for "
                                            "trainer.demos:write_demonstrations)")
    demonstrations: int = doc(64, "demonstration episodes")
    steps: int = doc(40, "optimizer steps")
    batch_size: int = doc(16, "episodes per step")
    lr: float = doc(1e-3, "AdamW learning rate")
    warmup_steps: int = doc(4, "linear learning-rate warm-up")
    init_weights: str = doc("", "weights to start from: a Kimi checkpoint folder or a .safetensors file (empty: the seed's initial weights)")
    threads: int = doc(0, "torch threads of the warm start, which runs before anything else starts (0: the cores "
                          "no other process keeps busy, measured over a second: on a machine shared with another run, two torch "
                          "processes of two threads each on two cores run several times slower than of one)")


@dataclass
class RLConfig:
    """GRPO: groups forked from one state, bounded staleness, partial rollouts, the loss."""

    iterations: int = doc(8, "training iterations (one optimizer step and one weight push each)")
    groups_per_iteration: int = doc(8, "GRPO groups per training batch")
    group_size: int = doc(4, "episodes per group, forked from one reset")
    max_staleness: int = doc(0, "0: synchronous, on-policy (rollouts, then training, strictly alternating); k >= 1: "
                                "rollouts for steps t+1..t+k run while step t trains, and trajectories more than k "
                                "weight versions old are dropped and counted")
    partial_rollouts: bool = doc(False, "an iteration's rollouts end once groups_per_iteration groups are complete; "
                                        "episodes still running are paused to the snapshot store and resumed in the "
                                        "next iteration under the new weights (each turn keeps its own version)")
    extra_groups: int = doc(0, "groups played beyond groups_per_iteration with partial rollouts (the long tail "
                               "they leave is paused, not waited for)")
    max_resumes: int = doc(2, "times a partial episode may be paused and resumed before it is dropped (counted)")
    lr: float = doc(2e-5, "AdamW learning rate")
    warmup_steps: int = doc(0, "linear learning-rate warm-up")
    grad_clip: float = doc(1.0, "max global grad norm (<= 0: none)")
    mini_batches: int = doc(1, "optimizer updates per iteration's batch. With 1 the PPO ratio is exactly 1 (the old "
                               "log-probs are the current ones), so eps_low / eps_high clipping and clip-higher never "
                               "act and the update is REINFORCE with the TIS weight (pi_train / pi_rollout) and the "
                               "group baseline; > 1 makes the later updates off-policy, where the clip ranges and "
                               "dual_clip bound them")
    micro_batch_tokens: int = doc(4096, "padded tokens per forward / backward")
    eps_low: float = doc(0.2, "PPO clip range below 1")
    eps_high: float = doc(0.28, "PPO clip range above 1 (DAPO's clip-higher)")
    tis_cap: float = doc(2.0, "truncated importance-sampling cap (<= 0: no TIS)")
    dual_clip: float = doc(3.0, "dual-clip c (Ye et al. 2020): a token with a negative advantage loses at most "
                                "c * |A|, however large its ratio (> 1; 0: off); acts only with mini_batches > 1")
    router_bias_rate: float = doc(1e-3, "aux-loss-free MoE balancing (DeepSeek-V3): after each step every router's "
                                        "selection bias moves by this toward balance, bias_i += rate * sign(mean "
                                        "load - load_i), loads from the training forward (0: off)")
    kl_coef: float = doc(0.0, "k3 KL penalty to the starting weights (> 0 keeps a frozen reference model)")
    baseline: str = doc("mean", "advantage baseline: mean (GRPO) or loo (leave-one-out)")
    std_normalize: bool = doc(True, "divide advantages by the group's std (GRPO); false: Dr. GRPO")
    drop_all_equal: bool = doc(False, "leave out groups whose rewards are all equal (no signal)")
    pass_threshold: float = doc(1.0, "a reward at least this counts as a pass")
    ckpt_every: int = doc(1, "checkpoint every N iterations (the last one always)")
    keep_checkpoints: int = doc(2, "checkpoints kept")
    routing_replay: bool = doc(False, "replay the rollout's recorded expert routing of every position (prompt, tool "
                                      "output, generated) in the training forward; needs policy.kind agentenv (the "
                                      "engine that returns routing); routing_replay/coverage reports the fraction "
                                      "of trained positions replayed")


@dataclass
class TrainerConfig:
    """The training processes (EP + DP on torch.distributed)."""

    world: int = doc(1, "training ranks (processes)")
    ep: int = doc(1, "expert-parallel ranks per group (divides world)")
    placement: str = doc("local", "where ranks 1..world-1 run: local (processes on this machine) or ray (actors "
                                  "spread over the nodes of the Ray cluster, ray.address)")
    device: str = doc("cpu", "cpu, or cuda (one GPU per rank)")
    dtype: str = doc("float32", "parameter dtype")
    threads: int = doc(0, "torch threads of this process (0: leave torch's default)")


@dataclass
class EvalConfig:
    """Held-out evaluation: after the warm start (before RL), every few iterations, and after RL."""

    enabled: bool = doc(True, "evaluate on the held-out tasks before and after RL")
    episodes: int = doc(64, "tasks evaluated (the first N of env.heldout_tasks, and of env.validation_tasks)")
    samples: int = doc(4, "samples per task (k): each evaluation reports mean@k and pass@k with 95% intervals "
                          "(bootstrap over tasks); the RL gain is a paired difference with its own interval")
    every: int = doc(0, "also evaluate on the validation tasks every N iterations (0: never; needs "
                        "env.validation_tasks)")
    temperature: float = doc(0.0, "sampling temperature (0: greedy; then samples > 1 repeat one another)")


@dataclass
class SWEConfig:
    """One iteration over SWE-v0 tasks through the same path: a group forked from one state, SWE grading, a step."""

    enabled: bool = doc(True, "run it after the RL iterations (needs Docker and the task's image)")
    env_id: str = doc("agentenv/SWE-v0", "the env")
    tasks: str = doc("envs/tasks/swe_tasks.jsonl", "task records")
    task_ids: list[str] = doc([], "which tasks (empty: the first `groups`)")
    groups: int = doc(1, "groups (tasks) played")
    group_size: int = doc(2, "episodes per group, forked from one reset")
    max_turns: int = doc(3, "policy calls per episode")
    max_new_tokens: int = doc(48, "tokens per policy call")
    max_total_tokens: int = doc(144, "generated tokens per episode")
    context_limit: int = doc(4096, "prompt + generated tokens per episode")
    env_kwargs: dict[str, Any] = doc({"max_output": 1500}, "keyword arguments of the env (a command's output is "
                                     "cut to max_output characters, so that episodes end graded, not at the "
                                     "context limit)")
    train: bool = doc(True, "take the training step on its trajectories too")


@dataclass
class MetricsConfig:
    """Experiment trackers the run also logs to (``trainer.trackers``), beside metrics.jsonl and the plots."""

    tracker: str = doc("", "wandb (an offline run in the run folder), tensorboard or mlflow (a local file store, or "
                           "metrics.uri); empty: none")
    project: str = doc("agentenv", "the W&B project / MLflow experiment")
    uri: str = doc("", "mlflow: a tracking server's URI instead of the run folder's file store")


@dataclass
class RunConfig:
    """A whole `agentenv train` run."""

    name: str = doc("main", "the run's name: its folder is out_dir/name")
    out_dir: str = doc("runs", "where run folders go")
    seed: int = doc(0, "initial weights, task order, sampling seeds (also --seed)")
    progress: str = doc("auto", "live display: auto (on a terminal), on, off")
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    swe: SWEConfig = field(default_factory=SWEConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def validate(self) -> RunConfig:
        """Raise ConfigError naming the first setting out of range."""
        checks: list[tuple[bool, str]] = [
            (self.policy.kind in ("agentenv", "sglang", "vllm"), "policy.kind must be agentenv, sglang or vllm"),
            (self.policy.verify in ("quick", "full", "off"), "policy.verify must be quick, full or off"),
            (self.policy.sync_mode in ("drain", "abort"), "policy.sync_mode must be drain or abort"),
            (self.policy.ep >= 1, "policy.ep must be at least 1"),
            (self.ray.workers >= 0, "ray.workers must be >= 0"),
            (self.rl.iterations >= 0, "rl.iterations must be >= 0"),
            (self.rl.groups_per_iteration >= 1, "rl.groups_per_iteration must be at least 1"),
            (self.rl.group_size >= 1, "rl.group_size must be at least 1"),
            (self.rl.max_staleness >= 0, "rl.max_staleness must be >= 0"),
            (self.rl.extra_groups >= 0, "rl.extra_groups must be >= 0"),
            (self.rl.max_resumes >= 0, "rl.max_resumes must be >= 0"),
            (self.rl.baseline in ("mean", "loo"), "rl.baseline must be mean or loo"),
            (self.rl.mini_batches >= 1, "rl.mini_batches must be at least 1"),
            (self.rl.dual_clip == 0 or self.rl.dual_clip > 1, "rl.dual_clip must be > 1 (or 0: off)"),
            (self.rl.router_bias_rate >= 0, "rl.router_bias_rate must be >= 0"),
            (self.env.harness in ("", "mini-swe-agent"), "env.harness must be mini-swe-agent (or empty)"),
            (self.env.harness_timeout_s > 0, "env.harness_timeout_s must be > 0"),
            (self.env.top_p == 1.0, f"env.top_p = {self.env.top_p}: training with top_p < 1 is refused, because the "
             "trainer computes each token's log-prob under the full temperature-scaled distribution, not the "
             "truncated, renormalised one the engine samples from, so the PPO / TIS ratios would be biased; "
             "set env.top_p = 1 (evaluation samples with top_p = 1 anyway)"),
            (self.trainer.world >= 1 and self.trainer.world % self.trainer.ep == 0,
             "trainer.ep must divide trainer.world"),
            (self.trainer.placement in ("local", "ray"), "trainer.placement must be local or ray"),
            (self.metrics.tracker in ("", "wandb", "tensorboard", "mlflow"),
             "metrics.tracker must be wandb, tensorboard, mlflow or empty"),
            (self.progress in ("auto", "on", "off"), "progress must be auto, on or off"),
            (self.env.max_turns >= 1, "env.max_turns must be at least 1"),
            (self.sft.steps >= 0 and self.sft.batch_size >= 1, "sft.steps >= 0 and sft.batch_size >= 1"),
            (self.sft.threads >= 0, "sft.threads must be >= 0 (0: the idle cores)"),
            (self.eval.episodes >= 0, "eval.episodes must be >= 0"),
            (self.eval.samples >= 1, "eval.samples must be at least 1"),
            (self.eval.every == 0 or bool(self.env.validation_tasks.strip()),
             "eval.every evaluates on the validation tasks: set env.validation_tasks (the held-out tasks are read "
             "only before and after RL)"),
            (self.swe.groups >= 1 and self.swe.group_size >= 1, "swe.groups and swe.group_size must be at least 1"),
            (bool(self.name) and "/" not in self.name, "name must be a plain folder name"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        for spec in (self.env.train_tasks, self.env.heldout_tasks, self.env.validation_tasks):
            if spec.strip():
                parse_task_spec(spec)
        return self


# --- tasks ------------------------------------------------------------------------------------------------


def parse_task_spec(spec: str) -> tuple[str, Any]:
    """``seeds:A-B`` -> ("seeds", range), ``ids:a,b`` -> ("ids", [...]), ``py:MODULE:FUNCTION k=v ...`` ->
    ("py", (function ref, kwargs)), else ("file", path)."""
    spec = spec.strip()
    if spec.startswith("py:"):
        ref, *args = spec[3:].split()
        if ":" not in ref:
            raise ConfigError(f"task spec {spec!r}: py:MODULE:FUNCTION [key=value ...]")
        kwargs: dict[str, Any] = {}
        for arg in args:
            key, sep, raw = arg.partition("=")
            if not sep or not key:
                raise ConfigError(f"task spec {spec!r}: arguments are key=value, got {arg!r}")
            kwargs[key] = _spec_value(raw)
        return "py", (ref, kwargs)
    if spec.startswith("seeds:"):
        lo, sep, hi = spec[6:].partition("-")
        try:
            a, b = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ConfigError(f"task spec {spec!r}: seeds:A-B takes two integers") from None
        if b < a:
            raise ConfigError(f"task spec {spec!r}: the range is empty")
        return "seeds", range(a, b + 1)
    if spec.startswith("ids:"):
        ids = [s.strip() for s in spec[4:].split(",") if s.strip()]
        if not ids:
            raise ConfigError(f"task spec {spec!r} names no task")
        return "ids", ids
    if not spec:
        raise ConfigError("an empty task spec")
    return "file", spec.removeprefix("file:")


def _spec_value(raw: str) -> Any:
    """An argument of a ``py:`` task spec: a TOML value without spaces (``8``, ``[1,2]``, ``"x"``), else the bare
    string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


# --- loading ---------------------------------------------------------------------------------------------


def load(path: str | Path | None = None, *, quick: bool = False, overrides: list[str] | tuple[str, ...] = (),
         base: RunConfig | None = None) -> RunConfig:
    """The defaults, then ``path``, then quick.toml (``quick``), then ``overrides``; validated."""
    cfg = base or RunConfig()
    layers: list[tuple[str, dict[str, Any]]] = []
    if path is not None:
        layers.append((str(path), read_toml(path)))
    if quick:
        layers.append((str(QUICK_TOML), read_toml(QUICK_TOML)))
    for item in overrides:
        layers.append((f"--set {item}", parse_override(item)))
    for name, data in layers:
        try:
            cfg = merge(cfg, data, "")
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}") from None
    return cfg.validate()


# --- rendering --------------------------------------------------------------------------------------------


def describe(cfg: RunConfig, comments: bool = True) -> str:
    """``cfg`` as TOML, each key with its documentation (and its default, where it differs) as a comment."""
    return render(cfg, RunConfig(), comments)


def defaults_toml() -> str:
    return describe(RunConfig())


def undocumented() -> list[str]:
    """Keys without documentation (a test keeps this empty)."""
    return typed_toml.undocumented(RunConfig)
