"""mini-swe-agent (the real package, unmodified) on agentenv sandboxes: its protocol, then ``DefaultAgent`` with its own
``DeterministicModel`` on a shipped SWE-v0 task graded by envs' grader, and a best-of-4 search from a forked state."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

import pytest
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from agentenv.harness.minisweagent import AgentenvEnvironment
from envs.grading import grade
from tests.integration.envs.swe_cases import reset_env

pytestmark = pytest.mark.integration
DOTTED = "agentenv.harness.minisweagent.AgentenvEnvironment"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"


@pytest.fixture(scope="module")
def swe():
    """A shipped toolz task, its env reset, and the task's pristine state (what grading restores)."""
    with reset_env("toolz") as (task, env):
        yield task, env, env.pristine()


def agent(env: AgentenvEnvironment, *commands: str, step_limit: int = 0) -> DefaultAgent:
    """mini's DefaultAgent with its own default prompts, and a DeterministicModel that issues ``commands``."""
    outputs = [make_output(f"THOUGHT: step {i}", [{"command": c}]) for i, c in enumerate(commands)]
    return DefaultAgent(DeterministicModel(outputs=outputs), env, **(get_config_from_spec("default")["agent"]
                                                                   | {"step_limit": step_limit}))


def write_patch(patch: str) -> str:
    return f"cat > /tmp/fix.patch <<'AGENTENV_PATCH_END'\n{patch}AGENTENV_PATCH_END"


def test_the_protocol_by_dotted_path_timeout_user_and_strict_config():
    env = get_environment({"environment_class": DOTTED, "cwd": "/tmp", "env": {"GREETING": "hi"}, "timeout": 2})
    try:
        assert isinstance(env, AgentenvEnvironment)
        out = env.execute({"command": "pwd; echo $GREETING; echo oops >&2; exit 3"})
        assert out == {"output": "/tmp\nhi\noops\n", "returncode": 3, "exception_info": ""}
        assert env.execute({"command": "pwd"}, cwd="/")["output"] == "/\n"
        out = env.execute({"command": "echo started; sleep 300 & sleep 300"})  # past the config's 2 s
        assert out["returncode"] == -1 and out["output"] == "started\n"
        assert out["extra"]["exception_type"] == "TimeoutExpired" and "timed out after 2 seconds" in out["exception_info"]
        assert env.execute({"command": "pgrep -x sleep || echo none"})["output"] == "none\n"  # the group was killed
        assert env.execute({"command": "sleep 3; echo done"}, timeout=20)["output"] == "done\n"  # the call's own wins
        tv = env.get_template_vars(extra=1)
        assert tv["system"] == "Linux" and tv["machine"] and tv["cwd"] == "/tmp" and tv["extra"] == 1
        assert env.serialize()["info"]["config"]["environment_type"] == DOTTED
    finally:
        env.cleanup()
    assert env.sandbox.state == "closed"
    nobody = AgentenvEnvironment(user="nobody")
    try:
        assert nobody.execute({"command": "id -un; touch /root/x"})["output"].startswith("nobody\n")
        assert nobody.execute({"command": "touch /root/x"})["returncode"] != 0
    finally:
        nobody.cleanup()
    with pytest.raises(ValueError, match="no_such_option"):
        AgentenvEnvironment(no_such_option=1)
    with pytest.raises(ValueError, match="cpus, memory"):  # a given sandbox keeps its limits: never ignored
        AgentenvEnvironment(sandbox=nobody.sandbox, cpus=4, memory="8g")
    dropped = AgentenvEnvironment()  # mini's runners drop an environment without cleanup(): it closes on deletion
    sandbox = dropped.sandbox
    del dropped
    gc.collect()
    assert sandbox.state == "closed"


def test_default_agent_submits_and_our_grader_scores_the_sandbox(swe):
    task, env, pristine = swe
    fixer = AgentenvEnvironment(snapshot=pristine.snapshot, cwd="/testbed")
    noop = AgentenvEnvironment(snapshot=pristine.snapshot, cwd="/testbed")
    try:
        result = agent(fixer, write_patch(task.patch), "git apply /tmp/fix.patch && git status --short", SUBMIT).run(
            task.problem_statement)
        assert result["exit_status"] == "Submitted" and "return len(seq) == len(set(seq))" in result["submission"]
        assert fixer.serialize()["info"]["config"]["environment"]["image"] == task.image  # the sandbox's own
        assert grade(fixer.sandbox, pristine.task, pristine=pristine.snapshot).reward == 1.0
        result = agent(noop, SUBMIT).run(task.problem_statement)
        assert result == {"exit_status": "Submitted", "submission": ""}
        graded = grade(noop.sandbox, pristine.task, pristine=pristine.snapshot)
        assert graded.reward == 0.0 and graded.patch == ""
    finally:
        fixer.cleanup()
        noop.cleanup()


def test_best_of_4_from_a_forked_state(swe):
    task, env, pristine = swe
    root = AgentenvEnvironment(snapshot=pristine.snapshot, cwd="/testbed")
    branches: list[AgentenvEnvironment] = []
    try:
        setup = agent(root, write_patch(task.patch), step_limit=1).run(task.problem_statement)
        assert setup["exit_status"] == "LimitsExceeded"  # one step, then the state to branch from
        branches = root.fork(4)
        target = task.test_files[0]
        continuations = [
            "true",                                                          # no change
            "sed -i 's/len(seq) != len(set(seq))/False/' toolz/itertoolz.py",  # a wrong fix
            "git apply /tmp/fix.patch",                                      # the fix the setup step wrote
            f"printf 'def test_isdistinct():\\n    pass\\n' > {target}",     # the test rewritten: dropped, not graded
        ]
        rewards = []
        for branch, command in zip(branches, continuations, strict=True):
            assert agent(branch, command, SUBMIT).run(task.problem_statement)["exit_status"] == "Submitted"
            rewards.append(grade(branch.sandbox, pristine.task, pristine=pristine.snapshot).reward)
        assert rewards == [0.0, 0.0, 1.0, 0.0]
        assert max(range(4), key=rewards.__getitem__) == 2
        assert root.execute({"command": "git status --short"})["output"] == ""  # the root did not move
        snap = root.snapshot()  # the branch point, kept: a later search starts from it again
        try:
            with AgentenvEnvironment(snapshot=snap, cwd="/testbed") as again:
                assert again.execute({"command": "git apply --check /tmp/fix.patch && echo ok"})["output"] == "ok\n"
        finally:
            snap.delete()
    finally:
        for b in branches:
            b.cleanup()
        root.cleanup()
