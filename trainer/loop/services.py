"""What ``agentenv train`` starts, and the pre-flight that runs before it starts anything.

``PolicyServer`` runs ``agentenv policy serve --preset k3-mini --ep N --port P --token-file T --weights W`` as a child
process in its own session (its log in the run folder), waits for ``/health`` — failing fast, with the log's tail,
if the process exits — and stops it (SIGTERM to its process group, then SIGKILL) at the end.

``preflight(cfg, ...)`` checks every part the run will use *before* anything starts, and raises ``PreflightError``
listing each part that is unreachable or missing with what to do: an existing policy endpoint (``--policy-url``:
``GET /v1/models`` with the token), an existing Ray cluster (``--ray-address``: its GCS port answers), the env id,
the task lists, the demonstration expert, the SWE task images (built where missing; a dry run only reports them) and Docker, a fixed port that is taken, and a run
folder that already holds a run (``--resume`` continues it). ``check_endpoint`` is the quick policy check run once
the endpoint is up: it lists the model, and a short completion returns token ids, one logprob each and the
weight version (``policy.verify = "full"`` runs ``agentenv policy verify`` instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from trainer.loop.config import ConfigError, RunConfig, parse_task_spec
from trainer.loop.tasks import resolve_function


class PreflightError(RuntimeError):
    """A part of the run is unreachable or missing; nothing was started."""


class ServerError(RuntimeError):
    """A policy server started here did not come up."""


def read_token(token_file: str) -> str | None:
    if token_file:
        return Path(token_file).read_text().strip()
    return os.environ.get("AGENTENV_POLICY_TOKEN") or None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (even by SIGKILL), so a server
    is never left behind by a killed run (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class PolicyServer:
    """``agentenv policy serve`` as a child process (see the module docstring)."""

    def __init__(self, cfg: RunConfig, folder: Path, weights: str | None) -> None:
        from policy.ranks import free_port  # torch: loaded only when a run starts its server

        self.cfg, self.folder, self.weights = cfg, folder, weights
        self.port = cfg.policy.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = folder / "policy.token"
        self.log_path = folder / "policy-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.token = ""

    def command(self) -> list[str]:
        p = self.cfg.policy
        cmd = [sys.executable, "-m", "agentenv", "policy", "serve", "--preset", p.preset, "--ep", str(p.ep),
               "--host", "127.0.0.1", "--port", str(self.port), "--token-file", str(self.token_file),
               "--max-context", str(p.max_context), "--max-batch", str(p.max_batch), "--seed", str(self.cfg.seed)]
        if self.weights:
            cmd += ["--weights", str(self.weights)]
        return cmd

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.token_file.exists():
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
        self.token = self.token_file.read_text().strip()
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("AGENTENV_POLICY_TOKEN", None)
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()

    def wait(self, timeout: float) -> None:
        """Until ``/health`` answers; ServerError (with the log's tail) if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"the policy server exited with status {self.proc.returncode}; its log "
                                  f"({self.log_path}) ends:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ServerError(f"the policy server at {self.url} did not answer /health within {timeout:.0f} s; "
                                  f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# --- checks -------------------------------------------------------------------------------------------------------


def _check_url(url: str, token: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        return f"the policy endpoint {url} is unreachable ({type(e).__name__}: {e}); start it or fix --policy-url"
    if r.status_code == 401:
        return f"the policy endpoint {url} refused the token (401); give policy.token_file or $AGENTENV_POLICY_TOKEN"
    if r.status_code >= 400:
        return f"the policy endpoint {url} answered GET /v1/models with HTTP {r.status_code}"
    return None


def _check_ray(address: str) -> str | None:
    if address in ("auto", "local"):
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
            return None
    except (OSError, ValueError) as e:
        return f"the Ray cluster at {address} is unreachable ({e}); start it (ray start --head) or fix --ray-address"


def _check_env(env_id: str) -> str | None:
    try:
        import gymnasium

        import envs  # noqa: F401  (registers the env ids)
    except ImportError as e:
        return f"the envs need Gymnasium ({e}); pip install -e '.[envs]' in the checkout"
    if env_id not in gymnasium.registry:
        ours = sorted(k for k in gymnasium.registry if k.startswith("agentenv/"))
        return f"no env {env_id!r} is registered; known: {', '.join(ours)}"
    return None


def _check_tasks(spec: str, what: str) -> str | None:
    try:
        kind, value = parse_task_spec(spec)
    except ConfigError as e:
        return f"{what}: {e}"
    if kind == "file" and not Path(value).is_file():
        return f"{what}: no task file at {value}"
    if kind == "py":
        ref, kwargs = value
        try:
            got = list(resolve_function(ref)(**kwargs))
        except Exception as e:  # noqa: BLE001 - the check's failure
            return f"{what}: {ref}({kwargs}) failed: {type(e).__name__}: {e}"
        if not got:
            return f"{what}: {ref}({kwargs}) listed no task"
    return None


def _check_apart(cfg: RunConfig) -> str | None:
    from trainer.loop.tasks import check_apart

    sets = {"env.train_tasks": cfg.env.train_tasks, "env.heldout_tasks": cfg.env.heldout_tasks}
    if cfg.env.validation_tasks.strip():
        sets["env.validation_tasks"] = cfg.env.validation_tasks
    return check_apart(cfg.env.id, sets)


def swe_task_records(cfg: RunConfig) -> list[dict[str, Any]]:
    """The SWE tasks the run plays: ``swe.task_ids`` of ``swe.tasks``, else its first ``swe.groups``."""
    from rollout.workers import load_task_refs

    records = load_task_refs(cfg.swe.tasks)
    if cfg.swe.task_ids:
        by_id = {str(r.get("instance_id")): r for r in records}
        missing = [t for t in cfg.swe.task_ids if t not in by_id]
        if missing:
            raise ConfigError(f"swe.task_ids: no task {', '.join(missing)} in {cfg.swe.tasks}")
        return [by_id[t] for t in cfg.swe.task_ids][: cfg.swe.groups]
    return records[: cfg.swe.groups]


def _check_swe(cfg: RunConfig, build: bool) -> str | None:
    """The SWE tasks load and their images are there; with ``build``, images a shipped or configured library makes
    are built first where missing (cached; seconds when up to date), so a fresh machine's first run needs no step
    of its own."""
    if not Path(cfg.swe.tasks).is_file():
        return f"swe.tasks: no task file at {cfg.swe.tasks} (or set swe.enabled = false)"
    try:
        records = swe_task_records(cfg)
        from envs.task import Task
        tasks = [Task.from_json(r) for r in records]
    except Exception as e:  # noqa: BLE001 - reported as the check's failure
        return f"swe.tasks: {type(e).__name__}: {e}"
    try:
        from envs.images import image_exists
        from envs.tasks.build import prepare_images
        from envs.tasks.libraries import load_libraries

        missing = [t for t in tasks if not image_exists(t.image)]
        if missing and build:
            names = sorted({t.image for t in missing})
            print(f"[pre-flight] building the SWE task images this run needs: {', '.join(names)} "
                  "(offline, cached; a minute or two the first time)", file=sys.stderr, flush=True)
            problems = prepare_images(missing, load_libraries(), build=True,
                                      log=lambda line: print(f"[pre-flight] {line}", file=sys.stderr, flush=True))
            if problems:
                return "; ".join(problems.values()) + " (or set swe.enabled = false)"
        elif missing:
            return (f"the SWE task image {missing[0].image} is missing; the run builds it (or build it now with "
                    "`agentenv tasks images`; or set swe.enabled = false)")
    except Exception as e:  # noqa: BLE001 - reported as the check's failure, named by what it is
        if _engine_unreachable(e):
            return (f"Docker is unreachable ({type(e).__name__}: {e}); run scripts/bootstrap.sh (or set "
                    "swe.enabled = false)")
        return (f"the SWE task images could not be checked or built: {type(e).__name__}: {e} (or set "
                "swe.enabled = false)")
    return None


def _engine_unreachable(e: BaseException) -> bool:
    """Whether ``e`` is the Docker engine not answering: a connection error somewhere in its chain of causes (the
    Docker SDK wraps them, and ``agentenv.host.images.docker_client`` wraps those). Any other failure is its own."""
    import requests

    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConnectionError | requests.exceptions.ConnectionError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _check_port(port: int) -> str | None:
    if not port:
        return None
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return f"policy.port {port} is taken (0 picks a free one)"
    return None


def preflight(cfg: RunConfig, *, resume: bool, build: bool = True) -> list[str]:
    """Every check (see the module docstring); returns what was checked, raises PreflightError listing failures.
    ``build``: build the task images the run needs where they are missing (a dry run only reports them)."""
    problems: list[str] = []
    checked: list[str] = []

    def run(name: str, check: Callable[[], str | None]) -> None:
        try:
            problem = check()
        except Exception as e:  # noqa: BLE001 - a check that breaks is a failed check
            problem = f"{name}: {type(e).__name__}: {e}"
        if problem:
            problems.append(problem)
        else:
            checked.append(name)

    run_dir = cfg.run_dir
    if not resume and (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        problems.append(f"{run_dir} holds a run; pass --resume to continue it, or choose another --name")
    if cfg.rl.routing_replay and cfg.policy.kind != "agentenv":
        problems.append(f"rl.routing_replay needs the expert routing of every position from the policy endpoint, "
                        f"which only agentenv's engine returns (return_routed_experts); policy.kind "
                        f"{cfg.policy.kind} cannot: set rl.routing_replay = false or serve with agentenv")
    if cfg.policy.url:
        run("policy endpoint", lambda: _check_url(cfg.policy.url, read_token(cfg.policy.token_file)))
    else:
        run("policy port", lambda: _check_port(cfg.policy.port))
    if cfg.ray.address and cfg.ray.workers > 0:
        run("ray cluster", lambda: _check_ray(cfg.ray.address))
    if cfg.metrics.tracker:
        from trainer.trackers import require

        run("tracker", lambda: require(cfg.metrics.tracker))
    run("env", lambda: _check_env(cfg.env.id))
    run("train tasks", lambda: _check_tasks(cfg.env.train_tasks, "env.train_tasks"))
    run("held-out tasks", lambda: _check_tasks(cfg.env.heldout_tasks, "env.heldout_tasks"))
    if cfg.env.validation_tasks.strip():
        run("validation tasks", lambda: _check_tasks(cfg.env.validation_tasks, "env.validation_tasks"))
    if cfg.eval.enabled:
        run("splits apart", lambda: _check_apart(cfg))
    if cfg.sft.enabled and not (run_dir / "sft" / "weights" / "config.json").is_file():
        def expert() -> str | None:
            try:
                resolve_function(cfg.sft.expert)
            except (ImportError, AttributeError, ConfigError) as e:
                return f"sft.expert {cfg.sft.expert}: {type(e).__name__}: {e}"
            return None
        run("demonstration expert", expert)
    if cfg.sft.init_weights and not Path(cfg.sft.init_weights).is_file():
        problems.append(f"sft.init_weights: no file at {cfg.sft.init_weights}")
    if cfg.swe.enabled:
        run("swe env", lambda: _check_env(cfg.swe.env_id))
        run("swe tasks and image", lambda: _check_swe(cfg, build))
    if problems:
        raise PreflightError("pre-flight failed; nothing was started:\n" + "\n".join(f"  - {p}" for p in problems))
    return checked


async def _quick_check(url: str, token: str | None, model: str | None) -> dict[str, Any]:
    from policy.client import PolicyClient
    from policy.tokenizer import load_tokenizer

    tok = load_tokenizer()
    prompt = tok.encode_chat([{"role": "user", "content": "Say hi."}])
    async with PolicyClient(url, token, model or None, max_retries=1, timeout=120) as client:
        listed = [str(m.get("id")) for m in await client.models()]
        if not listed:
            raise ServerError(f"{url}: /v1/models lists no model")
        c = await client.complete(prompt, max_tokens=4, temperature=1.0)
        s = c.samples[0]
        if not s.token_ids or s.logprobs is None or len(s.logprobs) != len(s.token_ids):
            raise ServerError(f"{url}: a completion did not return token ids with one logprob each")
        return {"models": listed, "weight_version": c.weight_version, "tokens": len(s.token_ids)}


def check_endpoint(url: str, token: str | None, model: str | None, mode: str) -> dict[str, Any]:
    """The endpoint's pre-flight once it is up (``mode``: quick, full, off); raises ServerError on a failure."""
    if mode == "off":
        return {}
    if mode == "full":
        from policy.verify import verify

        report = asyncio.run(verify(url, token, model or None))
        if not report.ok:
            raise ServerError(f"agentenv policy verify {url} failed: {', '.join(report.failed())}")
        return report.to_json()
    return asyncio.run(_quick_check(url, token, model))


