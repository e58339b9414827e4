"""A harness as the episode's driver: an unmodified agent harness plays the episode through the LLM gateway.

``agentenv rollout`` (``[rollout] harness = "mini-swe-agent"``) plays each episode of a group with the harness
instead of our own agent loop. The group still starts from one forked state: each episode's harness works in its
fork's sandbox (mini-swe-agent's ``DefaultAgent`` with ``agentenv.harness.minisweagent.AgentenvEnvironment`` over
that sandbox, run on the host) and talks to the policy through a gateway session of its own
(``rollout.gateway``, served on a loopback port of the worker by ``GatewayServer``). When the harness exits, the
env grades what it left (``grade_submission``: the submission and the sandbox, read from the host) and the
session's calls become the episode's records, one per branch (``rollout.gateway.export``).

Outcomes are typed (``metadata["outcome"]``), and an infrastructure failure never scores 0:

==============  =======================================================  =====================  ========
outcome         when                                                     finish_reason          reward
==============  =======================================================  =====================  ========
graded          the harness exited on its own (submitted, or stopped on  ``submitted``          the env's
                its own format errors): the env's grader decides
budget_stop     the run's budget (calls, tokens, wall time) or the       ``max_turns`` /        0.0
                harness's own step limit ended it before a submission    ``max_tokens``
timeout         it did not finish within ``timeout_s``                   ``timeout``            None
harness_error   the harness raised                                       ``harness_error``      None
infra_error     the engine failed a call, or the grader failed           ``policy_error`` /     None
                                                                         ``env_error``
==============  =======================================================  =====================  ========

The record of the branch that holds the session's last call is the episode's (its group index); records of the
other branches (a compaction, a subagent) come with it as ``branches``, with the same reward, group and index.
An episode whose harness made no call has one empty record with its outcome.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from envs.protocol import GymEnv, unwrap
from policy.chat import ChatEncoder
from rollout.agent import AgentConfig
from rollout.gateway import export
from rollout.gateway.app import create_app
from rollout.gateway.sessions import Budget, Session, SessionConfig
from rollout.gateway.turns import Gateway
from rollout.gateway.upstream import Sampling, Upstream
from rollout.trajectory import Trajectory

Outcome = Literal["graded", "budget_stop", "timeout", "harness_error", "infra_error"]
HARNESSES = ("mini-swe-agent", "command")
COMMAND_KEYS = {"command", "port"}     # a command harness's settings: what to run, the gateway's port inside


@dataclass(frozen=True)
class HarnessConfig:
    """Which harness drives episodes, its own settings, and the run's settings for its sessions. ``agent``:
    mini-swe-agent's agent config over its ``default`` one (e.g. ``step_limit`` or shorter templates); for
    ``command``, the command to run inside the sandbox and the port the gateway is forwarded to there (4000)."""

    name: str = "mini-swe-agent"
    agent: dict[str, Any] = field(default_factory=dict)
    budget: Budget = field(default_factory=Budget)
    sampling: Sampling = field(default_factory=Sampling)
    thinking: str = "keep"
    timeout_s: float = 1800.0
    cwd: str = ""                   # where the harness starts (empty: the env's workdir, where its task's files are)

    @classmethod
    def for_loop(cls, name: str, agent: dict[str, Any], loop: AgentConfig) -> HarnessConfig:
        """A harness whose sessions are held to the agent loop's limits: calls, tokens, one generation."""
        return cls(name, agent, Budget(loop.max_turns, loop.max_total_tokens),
                   Sampling(loop.temperature, loop.top_p, loop.max_new_tokens))

    def __post_init__(self) -> None:
        if self.name not in HARNESSES:
            raise ValueError(f"harness must be one of {', '.join(HARNESSES)}, got {self.name!r}")
        if self.name == "command" and (not isinstance(self.agent.get("command"), str)
                                       or set(self.agent) - COMMAND_KEYS):
            raise ValueError("a command harness takes command = \"...\" (what to run inside the sandbox) and, "
                             f"optionally, port = N; got {sorted(self.agent)}")
        if self.timeout_s <= 0:
            raise ValueError("a harness's timeout_s must be positive")


@dataclass
class HarnessExit:
    """How the harness ended: ``status`` is its own word (mini-swe-agent's ``exit_status``), ``error`` what it
    raised."""

    status: str = ""
    submission: str = ""
    error: str = ""


class LoopbackServer:
    """An ASGI app on a free loopback port, served by uvicorn on a thread of its own until ``close``."""

    def __init__(self, app: Any, name: str) -> None:
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                     timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, name=name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the {name} server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


class GatewayServer(LoopbackServer):
    """A gateway on a loopback port, for the harnesses of one worker."""

    def __init__(self, policy_url: str, policy_token: str | None, tokenizer: ChatEncoder) -> None:
        self.gateway = Gateway(Upstream(policy_url, policy_token), tokenizer)
        super().__init__(create_app(self.gateway), "gateway")

    def open(self, harness: HarnessConfig, labels: dict[str, str]) -> Session:
        return self.gateway.open(SessionConfig(harness.sampling, harness.budget, harness.thinking), labels)

    def openai_url(self, session: Session) -> str:
        """The base URL an OpenAI client of ``session`` is given."""
        return f"{self.url}/s/{session.id}/v1"

    def anthropic_url(self, session: Session) -> str:
        """The base URL an Anthropic client of ``session`` is given."""
        return f"{self.url}/s/{session.id}"


def run_mini_swe_agent(env: GymEnv, task: str, server: GatewayServer, session: Session,
                       harness: HarnessConfig) -> HarnessExit:
    """mini-swe-agent's ``DefaultAgent`` and ``LitellmModel``, unmodified, on the host, working in the episode's
    sandbox."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # litellm's bundled map: no fetch from the internet
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_from_spec
    from minisweagent.models.litellm_model import LitellmModel

    from agentenv.harness.minisweagent import AgentenvEnvironment

    litellm.suppress_debug_info = True   # its "Provider List" banner on every call of a model it cannot price
    box = unwrap(env).sandbox
    if box is None:
        raise RuntimeError("the episode has no sandbox for the harness to work in")
    model = LitellmModel(model_name="openai/agentenv-policy", cost_tracking="ignore_errors",
                         model_kwargs={"api_base": server.openai_url(session), "api_key": session.key})
    workspace = AgentenvEnvironment(sandbox=box, cwd=harness.cwd or unwrap(env).workdir)
    agent = DefaultAgent(model, workspace, **(get_config_from_spec("default")["agent"] | harness.agent))
    try:
        out = agent.run(task)
    except Exception as e:  # noqa: BLE001 - the harness's failure is the episode's outcome
        return HarnessExit("", "", f"{type(e).__name__}: {e}"[:2000])
    return HarnessExit(str(out.get("exit_status", "")), str(out.get("submission", "")))


def run_command(env: GymEnv, task: str, server: GatewayServer, session: Session, harness: HarnessConfig
                ) -> HarnessExit:
    """A harness installed in the sandbox's image, run there (``agent["command"]``): it reaches the gateway at an
    address inside the sandbox (``Sandbox.forward``: that one host port and nothing else of the host, with or without
    network) through ``OPENAI_BASE_URL`` / ``ANTHROPIC_BASE_URL`` and the session's key in ``OPENAI_API_KEY`` /
    ``ANTHROPIC_API_KEY``; the task is in ``AGENTENV_TASK``. An exit status of 0 submits what it printed."""
    from agentenv.sandbox.core import Sandbox

    box = unwrap(env).sandbox
    if not isinstance(box, Sandbox):
        return HarnessExit(error="a command harness runs in local sandboxes (forwards are local only), not in "
                                 f"{type(box).__name__}")
    inside = box.forward(int(harness.agent.get("port", 4000)), to=("127.0.0.1", server.port))
    base = f"{inside.url}/s/{session.id}"
    env_vars = {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": session.key, "ANTHROPIC_BASE_URL": base,
                "ANTHROPIC_API_KEY": session.key, "AGENTENV_TASK": task}
    r = box.exec(str(harness.agent["command"]), timeout=harness.timeout_s + 30,   # the run's own deadline first
                 env=env_vars, cwd=harness.cwd or unwrap(env).workdir)
    if r.timed_out:
        return HarnessExit("TimeExceeded")
    if r.exit_code != 0:
        return HarnessExit(error=f"the command exited {r.exit_code}: {r.stderr[-1500:]}")
    return HarnessExit("Submitted", r.stdout)


RUNNERS: dict[str, Callable[[GymEnv, str, GatewayServer, Session, HarnessConfig], HarnessExit]] = {
    "mini-swe-agent": run_mini_swe_agent, "command": run_command}
LIMITS = ("LimitsExceeded", "TimeExceeded")   # mini-swe-agent's own step, cost and time limits


def ended(done: HarnessExit | None, timeout_s: float, engine_errors: int, stopped: str | None
          ) -> tuple[Outcome, str, str]:
    """(outcome, finish reason, error) of a harness's end (the table of the module docstring); ``graded`` leaves the
    reward to the env's grader. ``done`` None: it ran past ``timeout_s``."""
    if done is None:
        return "timeout", "timeout", f"the harness ran past {timeout_s:g} s"
    if done.error:
        if engine_errors:
            return "infra_error", "policy_error", done.error
        return "harness_error", "harness_error", done.error
    if done.status in LIMITS or (stopped is not None and done.status != "Submitted"):
        return "budget_stop", "max_tokens" if stopped == "tokens" else "max_turns", ""
    return "graded", "submitted", ""


async def play_harness(env: GymEnv, task: str, server: GatewayServer, harness: HarnessConfig,
                       base: Trajectory) -> tuple[Trajectory, list[Trajectory]]:
    """One harness episode in ``env`` (reset, or forked from a reset): the episode's record and the records of its
    other branches (see the module docstring). ``base`` carries the task, group and index."""
    session = server.open(harness, {"task": base.task_id, "group": base.group_id, "index": str(base.group_index)})
    t0 = time.perf_counter()
    runner = RUNNERS[harness.name]
    try:
        done = await asyncio.wait_for(asyncio.to_thread(runner, env, task, server, session, harness),
                                      harness.timeout_s)
    except TimeoutError:
        done = None
    finally:
        server.gateway.close(session)    # a harness still running gets 401s from here on, and stops
    outcome, finish, error = ended(done, harness.timeout_s, session.errors, session.stopped)
    reward: float | None = 0.0 if outcome == "budget_stop" else None
    grade: dict[str, Any] = {}
    if outcome == "graded" and done is not None:
        try:
            reward, grade = await asyncio.to_thread(unwrap(env).grade_submission, done.submission)
        except Exception as e:  # noqa: BLE001 - the grader failed: infrastructure, not the policy
            outcome, finish, error = "infra_error", "env_error", f"grading: {type(e).__name__}: {e}"
    records = export.trajectories(session, task_id=base.task_id, env_id=base.env_id, reward=reward,
                                  finish_reason=finish, group_id=base.group_id, group_index=base.group_index,
                                  grade=grade, error=error[:2000])
    if not records:
        records = [Trajectory(task_id=base.task_id, env_id=base.env_id, group_id=base.group_id,
                              group_index=base.group_index, reward=reward, finish_reason=finish, grade=grade,
                              error=error[:2000])]
    last = session.tape.nodes[-1].branch if session.tape.nodes else None
    main = next((r for r in records if r.metadata.get("gateway", {}).get("branch") == last), records[-1])
    for r in records:
        r.seed, r.fork_s = base.seed, base.fork_s
        r.metadata.update(outcome=outcome, harness=harness.name, harness_exit=done.status if done else "",
                          harness_s=time.perf_counter() - t0)
    return main.check(), [r.check() for r in records if r is not main]


@dataclass
class HarnessDriver:
    """What the group player (``rollout.groups.run_group``) is given to play episodes with a harness."""

    server: GatewayServer
    config: HarnessConfig

    async def play(self, env: GymEnv, task: str, base: Trajectory) -> tuple[Trajectory, list[Trajectory]]:
        return await play_harness(env, task, self.server, self.config, base)

