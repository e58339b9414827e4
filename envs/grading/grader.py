"""``grade``: the agent's patch, filtered, applied to a fresh sandbox at the task's pristine state, tested there.

What runs where:

1. the agent's sandbox: ``extract_patch`` only (a ``git diff`` read out as data; see ``envs.grading.patch``);
2. the host: ``filter_patch`` (the documented rule) decides what is graded and what is dropped;
3. a new sandbox restored from ``pristine`` — a filesystem snapshot the env took at reset, before the
   agent acted (``SWEEnv`` keeps it; without one, a sandbox is set up from the task's image) — into
   which nothing of the agent's sandbox carries over but the kept patch:

   a. the kept patch, the task's test patch, the guard program (``sandbox_guard.py``) and a secret for
      this grading are written to a folder of its own (``/var/lib/agentenv-grade-<random>``, mode 700,
      outside /testbed); the image's git lists the files it will touch (``git apply --numstat``), which
      must be exactly the kept files in order (else the patch does not mean the same to the grader and
      to git: nothing runs, reward 0), then applies both; links the patch made must stay inside /testbed;
      what the task hid from the agent (``hidden_paths``: R2E-Gym's tests) is then put back from its image,
      over whatever the patch put there (``envs.grading.hidden``), and the guard refuses the patch's code
      any access to it;
   b. canaries, tests that must fail, are derived from the tests of the first FAIL_TO_PASS test's file
      and written into it beside the tests they copy (``envs.grading.canary``; a plain one when the file
      has none to copy), so nothing on pytest's command line points to them;
   c. the tests run with the image's interpreter by absolute path (resolved before the patch was
      applied), started by the guard (its audit hook installed before any repository code:
      ``envs.grading.audit``) instead of ``-m pytest``, ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` and only
      the plugins the task declares (``-p``; the record's ``pytest_plugins``, kept in
      ``task.metadata``), ``PYTHON*`` and ``PYTEST_*`` variables cleared (``PYTHONPATH`` as the image
      sets it), no cache provider, and pytest asked for a JUnit XML file in the grading folder; when
      they end, every other process in the sandbox is killed, the FAIL_TO_PASS tests and the canaries
      are called again on their own in a second guarded interpreter (``envs.grading.isolation``), and
      every other process is killed again before the files are read;
   d. statuses come from the JUnit file (``envs.grading.results``), the text log only adds XPASS and the
      failure messages; the run was tampered with (reward 0, ``tampering_reasons``) when the guard's log
      shows a refused event, a canary is reported anything but FAILED (or ERROR), or the isolated run
      disagrees with pytest's report (a test reported passing that fails on its own, a canary passing
      there, its result missing or without the secret); all read by ``envs.grading.readout``;
4. the grading sandbox is closed (by ``SWEEnv`` on a worker thread; ``env.close()`` waits for it).

The canaries are not used when the command selects tests (``-k``, ``-m``, ``--deselect``, ``--lf``, ...) or
names no ``{tests}``. A repository whose pristine configuration does not collect ``test_*`` functions
(``python_functions``) or marks whole test modules xfail would trip it with every patch, the gold one
too: ``agentenv tasks validate`` shows such a task.

How the task's ``test_command`` is run is ``envs.grading.command``'s: a plain pytest invocation keeps its
arguments and gets the grader's options, the guard and the isolated run; any other command runs as the
task gives it, without them. The pristine repository's own pytest configuration is used (the patch
cannot change it: ``test-config`` drops).

A task is resolved when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes (a test
missing from the results counts as failed), as SWE-bench decides, and nothing else went wrong: the
patch was extracted within its size limit and applied, the tests did not time out, the result file
was there and well formed, and no sign of tampering showed (canaries, audit hook, isolated run).
"""

from __future__ import annotations

import dataclasses
import secrets
from concurrent.futures import Future

import agentenv
from agentenv.api import Backend, SandboxLike, SnapshotLike
from agentenv.errors import AgentEnvError
from envs.grading import audit, canary, channels, hidden, isolation, prepare
from envs.grading.command import Invocation, declared_plugins, parse_test_command, run_script
from envs.grading.diff import parse_numstat
from envs.grading.outcome import GradeResult, failed
from envs.grading.patch import (
    WORKDIR,
    FilteredPatch,
    PatchError,
    check_numstat,
    extract_patch,
    filter_patch,
    gold_exemptions,
    link_stays_inside,
)
from envs.grading.readout import Run, hardened, official_only
from envs.grading.runners.official import OfficialHarnessError
from envs.grading.runners.spec import APPLY_5, Runner, RunnerError, runner_for
from envs.grading.workers import Timer, close_later, close_started, run_in_background
from envs.task import Task

__all__ = ["GradeResult", "Invocation", "declared_plugins", "filter_for", "grade", "parse_test_command",
           "protected_files", "run_script"]
DEFAULT_TIMEOUT = 900.0
GRADING_TTL = 4 * 3600.0  # a grading sandbox's deadline: past any test run (the agentenv default is minutes)
GRADE_ROOT = "/var/lib/agentenv-grade-"


def protected_files(task: Task) -> list[str]:
    """The task's test files and the files its test patch touches: never taken from the agent's patch."""
    from envs.grading.diff import parse_section, split_sections

    files = [*task.test_files, *hidden.inside(task)]
    if task.test_patch:
        for raw in split_sections(task.test_patch.encode("utf-8", "surrogateescape"))[1]:
            files += parse_section(raw).paths
    return list(dict.fromkeys(files))


def filter_for(task: Task, patch: bytes) -> FilteredPatch:
    """``filter_patch`` with the task's test files, plugins and gold-patch exemptions, and its runner's own files
    and test suite (``channels.protected``: Django's, SymPy's)."""
    paths, reasons = gold_exemptions(task.patch)
    test_patterns, runner_files = channels.protected(task, task.eval_script + task.test_command)
    return filter_patch(patch, tests=protected_files(task), runner_modules=declared_plugins(task),
                        exempt_paths=paths, exempt_reasons=reasons, runner_files=runner_files,
                        test_patterns=test_patterns)


def grade(sandbox: SandboxLike, task: Task, *, pristine: SnapshotLike | str | None = None,
          api: Backend | None = None, timeout: float | None = None,
          closing: list[Future[None]] | None = None, trust_official_log: bool = False) -> GradeResult:
    """Grade the agent's /testbed in ``sandbox`` against ``task`` (see the module doc).

    ``pristine``: a filesystem snapshot of the task's sandbox taken before the agent acted (on ``api``,
    default this host); without one a fresh sandbox of the task is set up, which costs a reset. The
    grading sandbox is restored while the patch is being extracted. ``timeout``: seconds for the tests
    (default: the dataset harness's own, else 900). ``closing``: close the grading sandbox on a worker thread
    and append its future here (the caller waits for it later); by default it is closed before ``grade``
    returns. The agent's sandbox is left as it was.

    A runner no hardened channel runs is read from its output alone (``forgeable``: the code under test prints
    that output, and can print a runner's result lines), which scores 0 whatever it says, with the official verdict
    recorded and the reason given; ``trust_official_log=True`` lets that reading set the reward (for tasks whose
    code you trust, never for RL on a policy's patches).
    """
    result = _graded(sandbox, task, pristine, api, timeout, closing)
    if result.forgeable and result.resolved and not trust_official_log:
        return dataclasses.replace(result, resolved=False, error=(
            f"no hardened channel runs this runner ({result.runner}): only the official parser's reading of the "
            "output says resolved, and the code under test writes that output (it can print result lines); "
            "grade(..., trust_official_log=True) / SWEEnv(trust_official_log=True) takes it for tasks you trust"))
    return result


def _graded(sandbox: SandboxLike, task: Task, pristine: SnapshotLike | str | None, api: Backend | None,
            timeout: float | None, closing: list[Future[None]] | None) -> GradeResult:
    from envs import task_sandbox

    backend: Backend = agentenv if api is None else api
    timer = Timer()
    if pristine is None:
        starting: Future[tuple[SandboxLike, Task]] = run_in_background(
            lambda: task_sandbox.start_task(task, backend, ttl=GRADING_TTL))
    else:
        labels = {"agentenv.kind": "grading", "agentenv.task": task.instance_id}
        starting = run_in_background(lambda: (backend.Sandbox.restore(pristine, labels=labels, ttl=GRADING_TTL), task))
    grader: SandboxLike | None = None
    try:
        if task.base_commit == "HEAD":  # the base commit is known once the task's sandbox is set up
            grader, task = starting.result()
            timer.lap("sandbox")
        building = run_in_background(runner_for, task)  # a 4.x eval script comes from the official process
        packing = run_in_background(hidden.pack, task, backend) if task.hidden_paths else None  # from its image
        try:
            raw = extract_patch(sandbox, task.base_commit)
        except PatchError as e:
            timer.lap("extract")
            return dataclasses.replace(failed(task, "", str(e)), timings=dict(timer.phases))
        timer.lap("extract")
        filtered = filter_for(task, raw)
        timer.lap("filter")
        try:
            runner = building.result()
        except (RunnerError, OfficialHarnessError) as e:
            return dataclasses.replace(failed(task, raw.decode("utf-8", "replace"), str(e)),
                                       timings=dict(timer.phases))
        if grader is None:
            grader, task = starting.result()
            timer.lap("sandbox")
        limit = timeout if timeout is not None else (runner.timeout or DEFAULT_TIMEOUT)
        result = _grade_in(grader, task, runner, raw, filtered, limit, timer, packing)
    finally:
        if grader is None:  # extraction failed (or the start did): close the grading sandbox once it is up
            if closing is not None:
                closing.append(run_in_background(close_started, starting))
            else:
                close_started(starting)
        elif closing is not None:
            closing.append(close_later(grader))
        else:
            grader.close()
            timer.lap("close")
    return dataclasses.replace(result, timings=dict(timer.phases))


def _prepared(sb: SandboxLike, run: Run, folder: str, interp: str, canary_file: str,
              packed: bool) -> dict[str, str] | GradeResult:
    """Step 3a (``envs.grading.prepare``): the patches applied and checked; the fields it printed, or a failure."""
    task, runner, filtered = run.task, run.runner, run.filtered
    activate = [x for x in runner.preamble() if x.startswith(("source ", "conda activate", ". "))]
    r = sb.exec(prepare.script(folder, interp, bool(filtered.kept), bool(task.test_patch), canary_file,
                               apply=runner.apply, reset_between=runner.apply == APPLY_5, activate=activate,
                               restore=hidden.restore_lines(task, folder, packed)),
                timeout=300, cwd=WORKDIR)
    found = prepare.fields(r.stdout)
    if "fail" in found:
        what, _, err = found["fail"].partition(" ")
        why = {"numstat": "git cannot read the patch", "apply": "the patch does not apply to the base commit",
               "test_patch": "the task's test patch does not apply",
               "hidden": "what the task hides from the agent could not be put back"}.get(what, what)
        return run.fail(f"{why}: {prepare.b64(err).decode('utf-8', 'replace').strip()[-400:]}")
    if found.get("ok") != "1":
        return run.fail(f"could not prepare the grading sandbox ({r.exit_code}): {(r.stdout + r.stderr).strip()[-400:]}")
    if filtered.kept:
        mismatch = check_numstat(filtered, parse_numstat(prepare.b64(found.get("numstat", ""))))
        if mismatch:
            return run.fail(f"the patch does not mean the same to the grader and to git: {mismatch}", tampering=True)
        outside = prepare.changed_paths(prepare.b64(found.get("changed", ""))) - filtered.paths
        if found.get("applied", "0") != "0" and outside:
            return run.fail(f"the fallback {runner.apply[int(found['applied'])]!r} changed files the patch does not "
                            f"name: {sorted(outside)[:5]}", tampering=True)
    links = prepare.b64(found.get("links", "")).split(b"\0")
    for path_b, target_b in zip(links[0::2], links[1::2], strict=False):
        path, target = path_b.decode("utf-8", "surrogateescape"), target_b.decode("utf-8", "surrogateescape")
        if path in filtered.paths and not link_stays_inside(path, target):
            return run.fail(f"the patch made {path!r} a link to {target!r}, outside the repository", tampering=True)
    return found


def _grade_in(sb: SandboxLike, task: Task, runner: Runner, raw: bytes, filtered: FilteredPatch, timeout: float,
              timer: Timer, packing: Future[bytes] | None) -> GradeResult:
    run = Run(task, runner, raw.decode("utf-8", "replace"), filtered, tampering=filtered.tampering)
    folder = GRADE_ROOT + secrets.token_hex(8)
    dataset = runner.family != "agentenv"
    inv = parse_test_command(runner.test_command if dataset else task.test_command)
    guarded = inv.args is not None
    secret = isolation.new_secret()
    files = {**{f"{folder}/{name}": text for name, text in audit.guard_files().items()},
             f"{folder}/{isolation.KEY_FILE}": secret.encode()}
    if filtered.kept:
        files[f"{folder}/model.patch"] = filtered.kept
    if task.test_patch:
        files[f"{folder}/test.patch"] = task.test_patch.encode("utf-8", "surrogateescape")
    try:
        packed = packing.result() if packing is not None else b""
    except AgentEnvError as e:
        return run.fail(str(e))
    if packed:
        files[f"{folder}/{hidden.ARCHIVE}"] = packed
    for path, data in files.items():
        sb.write_file(path, data, mode=0o600)
    interp = inv.interpreter if inv.args is not None and inv.interpreter != "pytest" else "python3"
    canary_file = task.FAIL_TO_PASS[0].split("::", 1)[0] if task.FAIL_TO_PASS else ""
    if inv.channel is not None:  # Django's, SymPy's: the file of the first FAIL_TO_PASS test, by its runner's ids
        canary_file = inv.channel.canary_file(task)
    elif not (inv.canary_allowed(canary_file if dataset else "") and canary_file.endswith(".py")):
        canary_file = ""
    found = _prepared(sb, run, folder, interp, canary_file, bool(packed))
    if isinstance(found, GradeResult):
        return found
    timer.lap("apply")
    python = prepare.python(inv, found) if guarded else ""
    if guarded and not python.startswith("/"):
        return run.fail(f"the image has no interpreter for {inv.interpreter!r} on its PATH")
    canary_ids = _add_canaries(sb, task, inv, canary_file, found) if canary_file and "canary_src" in found else []
    solo_ids = isolation.solo_tests(task.FAIL_TO_PASS, canary_ids) if guarded else []
    cfg = audit.config(folder, filtered, solo_ids)
    if inv.channel is not None:
        cfg.update(inv.channel.solo_config())
    cfg["paths"] += hidden.guard_paths(task, runner.links)
    if found.get("applied", "0") != "0":  # a fallback applied it: line numbers no longer follow the patch
        cfg["patched"] = dict.fromkeys(cfg["patched"])
    sb.write_file(f"{folder}/{audit.CONFIG_FILE}", audit.config_bytes(cfg), mode=0o600)
    timer.lap("apply")
    script = run_script(task, inv, python, folder, guarded=guarded, solo=bool(solo_ids),
                        preamble=runner.preamble() if dataset else None, command=runner.test_command)
    if dataset:
        sb.write_file(f"{folder}/eval.sh", script.encode(), mode=0o600)
        script = f"exec /bin/bash {folder}/eval.sh"  # no parent shell for its kill -1 to end
    r = sb.exec(script, timeout=timeout, cwd=WORKDIR)
    run.exit_code, run.timed_out, run.log = r.exit_code, r.timed_out, r.stdout + r.stderr
    timer.lap("tests")
    if r.timed_out:
        return run.fail(f"the tests timed out after {timeout:g} s")
    if dataset and not guarded:  # no hardened channel runs this runner: the official reading of the log decides
        return official_only(run, timer)
    return hardened(sb, run, folder, secret, canary_ids, solo_ids, timer, guarded=guarded, channel=inv.channel)


def _add_canaries(sb: SandboxLike, task: Task, inv: Invocation, test_file: str, found: dict[str, str]) -> list[str]:
    """Step 3b: the canaries written into ``test_file`` (derived from its tests; a plain one when it has none)."""
    source = prepare.b64(found.get("canary_src", "")).decode("utf-8", "surrogateescape")
    if inv.channel is not None:
        text, ids = inv.channel.canaries(source, task, test_file)
        if ids:
            sb.write_file(f"{WORKDIR}/{test_file}", text.encode("utf-8", "surrogateescape"))
        return ids
    derived = canary.derive(source)
    if derived is None:
        name = f"test_{secrets.token_hex(8)}"
        text, names = source + canary.plain(name), [name]
    else:
        text, names = derived.source, list(derived.names)
    sb.write_file(f"{WORKDIR}/{test_file}", text.encode("utf-8", "surrogateescape"))
    return [f"{test_file}::{n}" for n in names]
