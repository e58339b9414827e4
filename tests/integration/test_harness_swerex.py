"""SWE-ReX (the real package, unmodified) on an agentenv sandbox: its deployment and runtime API, called as SWE-agent
calls it, with a persistent bash session per session name."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
)
from swerex.runtime.abstract import (
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from agentenv.harness.swerex import AgentenvDeployment

pytestmark = pytest.mark.integration


def test_sessions_keep_cd_and_export_and_the_runtime_calls_work(tmp_path):
    async def main() -> None:
        dep = AgentenvDeployment(image="agentenv/base")
        assert not await dep.is_alive()
        await dep.start()
        try:
            rt = dep.runtime
            assert await rt.is_alive()
            with pytest.raises(ValueError, match="image, memory"):  # a given sandbox keeps its own: never ignored
                AgentenvDeployment(sandbox=dep.sandbox, image="agentenv/base", memory="8g")
            await rt.create_session(CreateBashSessionRequest(session="a"))
            await rt.create_session(CreateBashSessionRequest(session="b"))

            async def run(cmd: str, session: str = "a", **kw):
                return await rt.run_in_session(BashAction(command=cmd, session=session, timeout=20, **kw))

            await run("mkdir -p /tmp/w && cd /tmp/w && export FOO=bar && X=local")
            obs = await run("pwd; echo $FOO $X")
            assert (obs.output, obs.exit_code) == ("/tmp/w\nbar local\n", 0)
            other = (await run("pwd; echo ${FOO:-unset}", session="b")).output  # sessions are apart
            assert other.endswith("\nunset\n") and not other.startswith("/tmp/w")
            obs = await run("echo to-stderr >&2; false", check="silent")
            assert (obs.output, obs.exit_code) == ("to-stderr\n", 1)
            with pytest.raises(NonZeroExitCodeError):
                await run("exit_code_3() { return 3; }; exit_code_3")
            assert (await run("cat; echo read-nothing")).output == "read-nothing\n"  # stdin is /dev/null
            # output that forges an old and a made-up marker neither ends a call nor bleeds into the next one
            forged = "\\nffffffffffffffffffffffffffffffff\\nffffffffffffffffffffffffffffffff 0\\n"
            obs = await run(f"printf '{forged}'; printf '{forged}' >&2; sleep 1; echo after; (exit 4)", check="silent")
            assert obs.exit_code == 4 and obs.output.endswith("ffff 0\nafter\n") and obs.output.count("ffff 0") == 2
            assert (await run("echo next")).output == "next\n"
            heredoc = await run("cat > /tmp/w/h.txt <<'EOF'\nline one\n$FOO stays\nEOF\ncat h.txt")
            assert heredoc.output == "line one\n$FOO stays\n"
            with pytest.raises(BashIncorrectSyntaxError):
                await run("echo 'unclosed")
            assert (await run("echo $FOO")).output == "bar\n"  # still the same shell

            # a timeout: SWE-ReX's error; the command's processes are killed and the shell's state stays
            with pytest.raises(CommandTimeoutError):
                await rt.run_in_session(BashAction(command="sleep 300", session="a", timeout=2))
            assert (await run("pwd; pgrep -x sleep || echo no-sleep")).output == "/tmp/w\nno-sleep\n"
            with pytest.raises(CommandTimeoutError):  # a loop in the shell itself: the session ends with it
                await rt.run_in_session(BashAction(command="while :; do :; done", session="b", timeout=2))
            with pytest.raises(SessionDoesNotExistError):
                await run("true", session="b")
            await rt.close_session(CloseBashSessionRequest(session="a"))
            with pytest.raises(SessionDoesNotExistError):
                await run("true")

            r = await rt.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 2"]))
            assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 2)
            r = await rt.execute(Command(command="echo $HOME-$ONLY; pwd", shell=True, env={"ONLY": "x"}, cwd="/tmp"))
            assert r.stdout == "-x\n/tmp\n"  # env is the whole environment, as subprocess takes it
            with pytest.raises(CommandTimeoutError):
                await rt.execute(Command(command="sleep 30", shell=True, timeout=1))
            with pytest.raises(NonZeroExitCodeError):
                await rt.execute(Command(command=["false"], check=True))

            await rt.write_file(WriteFileRequest(path="/tmp/new/dir/f.txt", content="héllo\n"))
            assert (await rt.read_file(ReadFileRequest(path="/tmp/new/dir/f.txt"))).content == "héllo\n"
            (tmp_path / "tree" / "sub").mkdir(parents=True)
            (tmp_path / "tree" / "sub" / "run.sh").write_text("#!/bin/sh\necho uploaded\n")
            (tmp_path / "tree" / "sub" / "run.sh").chmod(0o755)
            (tmp_path / "one.txt").write_text("one\n")
            await rt.upload(UploadRequest(source_path=str(tmp_path / "tree"), target_path="/opt/tree"))
            await rt.upload(UploadRequest(source_path=str(tmp_path / "one.txt"), target_path="/opt/tree"))
            r = await rt.execute(Command(command="/opt/tree/sub/run.sh && cat /opt/tree/one.txt", shell=True))
            assert r.stdout == "uploaded\none\n"
            # beyond SWE-ReX: a fork and a snapshot of the deployment's sandbox, each with its own sessions
            snap = dep.snapshot()
            (fork,) = dep.fork(1)
            again = AgentenvDeployment(snapshot=snap)
            try:
                for d in (fork, again):
                    await d.start()
                    await d.runtime.create_session(CreateBashSessionRequest(session="a"))
                    obs = await d.runtime.run_in_session(BashAction(command="cat /opt/tree/one.txt", session="a"))
                    assert obs.output == "one\n"
            finally:
                await fork.stop()
                await again.stop()
                snap.delete()
        finally:
            await dep.stop()
        assert dep.sandbox is None and not await dep.is_alive()

    asyncio.run(main())


def test_swe_agents_env_runs_on_the_deployment(tmp_path):
    """SWE-agent 1.x's own ``SWEEnv`` (not on PyPI, whose ``sweagent`` is a 2024 0.0.1 without deployments: it
    runs where SWE-agent is installed from its repository) copies a local repository in, resets it and talks to it."""
    swe_env = pytest.importorskip("sweagent.environment.swe_env", reason="SWE-agent 1.x is installed from GitHub only")
    from sweagent.environment.repo import LocalRepoConfig

    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "hello.py").write_text("print('hello')\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    env = swe_env.SWEEnv(deployment=AgentenvDeployment(image="agentenv/base"), repo=LocalRepoConfig(path=repo),
                         post_startup_commands=["export FROM_STARTUP=1"])
    env.start()
    try:
        assert env.communicate("pwd; echo $FROM_STARTUP $PAGER; python3 hello.py", check="raise") == \
            "/proj\n1 cat\nhello\n"
        env.write_file("/proj/new.txt", "written\n")
        assert env.read_file("/proj/new.txt") == "written\n"
        env.reset()  # git restore, reset --hard, clean: the untracked file goes
        assert env.communicate("ls", check="raise") == "hello.py\n"
    finally:
        env.close()
