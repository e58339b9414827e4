"""inspect-ai (the real package, unmodified) running its samples in agentenv sandboxes: ``eval()`` of a Task with
``sandbox=("agentenv", Dockerfile)``, found through the ``inspect_ai`` entry point pyproject.toml declares, a
mockllm model scripted to call the ``bash`` tool, and a scorer that reads the file back from the sandbox; then the
provider's own contract (user, stdin, timeout, limits, files, fork) through inspect's sample_init/sample_cleanup."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

inspect_ai = pytest.importorskip("inspect_ai", reason="inspect-ai is the harness extra (agentenv[inspect])")

from inspect_ai import Task, eval  # noqa: E402
from inspect_ai.dataset import Sample  # noqa: E402
from inspect_ai.model import ChatMessageTool, ModelOutput, ModelUsage, get_model  # noqa: E402
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer  # noqa: E402
from inspect_ai.solver import TaskState, generate, use_tools  # noqa: E402
from inspect_ai.tool import bash  # noqa: E402
from inspect_ai.util import OutputLimitExceededError, SandboxUserUnsupportedError, sandbox  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "mockllm/model"


@pytest.fixture(scope="module")
def entry_point(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``inspect_ai`` entry point as pyproject.toml declares it, installed as a distribution's metadata is (an
    environment installed before the entry point existed lacks it), so inspect's own loader imports the provider."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["inspect_ai"]
    assert declared == {"agentenv": "agentenv.harness.inspect_ai_sandbox"}
    site = tmp_path_factory.mktemp("site")
    meta = site / "agentenv_inspect_ep-0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: agentenv-inspect-ep\nVersion: 0\n")
    (meta / "entry_points.txt").write_text(f"[inspect_ai]\nagentenv = {declared['agentenv']}\n")
    sys.path.insert(0, str(site))
    try:
        assert any(ep.value == declared["agentenv"] for ep in importlib.metadata.entry_points(group="inspect_ai"))
        yield str(site)
    finally:
        sys.path.remove(str(site))


@pytest.fixture
def dockerfile(tmp_path: Path) -> Iterator[Path]:
    """A task's Dockerfile (built locally by the provider, never pulled); its image removed afterwards."""
    path = tmp_path / "Dockerfile"
    path.write_text("FROM agentenv/base\nRUN mkdir -p /work && echo built > /work/built.txt\nWORKDIR /work\n")
    yield path
    from agentenv.harness.inspect_ai_sandbox import AgentenvSandboxConfig, image_of
    from agentenv.host import images

    tag = image_of(AgentenvSandboxConfig(dockerfile=str(path)))
    if images.present(tag):
        images.docker_client().images.remove(tag, force=True)


def scripted(messages: list[Any], tools: list[Any], tool_choice: Any, config: Any) -> ModelOutput:
    """The model: a bash call that writes answer.txt (what it writes named by the sample's prompt), then a reply.
    Its usage is given, so mockllm does not count tokens (tiktoken would download its tables)."""
    if isinstance(messages[-1], ChatMessageTool):
        out = ModelOutput.from_content(model=MODEL, content="written")
    else:
        word = str(messages[-1].content).split()[-1]
        out = ModelOutput.for_tool_call(model=MODEL, tool_name="bash",
                                        tool_arguments={"command": f"echo {word} > answer.txt && whoami"})
    out.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return out


@scorer(metrics=[accuracy()])
def file_says_hello() -> Any:
    """CORRECT when the sandbox's answer.txt holds the target; also records what a nobody command sees."""
    async def score(state: TaskState, target: Target) -> Score:
        text = await sandbox().read_file("answer.txt")
        uid = await sandbox().exec(["id", "-u"], user="nobody")
        tool_said = [m.text for m in state.messages if isinstance(m, ChatMessageTool)]
        return Score(value=CORRECT if text.strip() == target.text else INCORRECT, answer=text,
                     metadata={"nobody_uid": uid.stdout.strip(), "tool_said": tool_said})
    return score


def test_an_inspect_eval_runs_its_samples_in_agentenv_sandboxes(entry_point: str, dockerfile: Path,
                                                               tmp_path: Path) -> None:
    task = Task(dataset=[Sample(input="write hello", target="hello", id="right"),
                         Sample(input="write goodbye", target="hello", id="wrong")],
                solver=[use_tools(bash(timeout=30)), generate()], scorer=file_says_hello(),
                sandbox=("agentenv", str(dockerfile)))
    [log] = eval(task, model=get_model(MODEL, custom_outputs=scripted), log_dir=str(tmp_path / "logs"),
                 display="none", max_samples=2)
    assert log.status == "success", log.error
    by_id = {s.id: s for s in log.samples or []}
    scores = {i: next(iter((s.scores or {}).values())) for i, s in by_id.items()}
    assert scores["right"].value == CORRECT and scores["right"].answer == "hello\n"
    assert scores["wrong"].value == INCORRECT and scores["wrong"].answer == "goodbye\n"
    for s in scores.values():
        assert s.metadata == {"nobody_uid": "65534", "tool_said": ["root\n"]}


def _with_sandbox(check: Any, config: Any = None) -> None:
    """``check(env)`` on a sandbox made and cleaned up by the provider's own sample_init / sample_cleanup."""
    from agentenv.harness.inspect_ai_sandbox import AgentenvSandboxEnvironment

    async def main() -> None:
        await AgentenvSandboxEnvironment.task_init("t", config)
        envs = await AgentenvSandboxEnvironment.sample_init("t", config, {})
        try:
            await check(envs["default"])
        finally:
            await AgentenvSandboxEnvironment.sample_cleanup("t", config, envs, False)
            await AgentenvSandboxEnvironment.task_cleanup("t", config, True)

    anyio.run(main)


def test_exec_honours_user_stdin_cwd_env_and_timeout() -> None:
    async def check(env: Any) -> None:
        assert (await env.exec(["id", "-un"], user="nobody")).stdout == "nobody\n"
        assert (await env.exec(["id", "-un"], user="65534")).stdout == "nobody\n"
        assert (await env.exec(["id", "-u"])).stdout == "0\n"
        with pytest.raises(SandboxUserUnsupportedError, match="ghost"):
            await env.exec(["id"], user="ghost")
        with pytest.raises(SandboxUserUnsupportedError, match="4242"):
            await env.exec(["id"], user="4242")
        piped = await env.exec(["sh", "-c", "tr a-z A-Z; echo oops >&2; exit 3"], input="piped in\n")
        assert (piped.returncode, piped.success, piped.stdout, piped.stderr) == (3, False, "PIPED IN\n", "oops\n")
        assert (await env.exec(["pwd"])).stdout == "/testbed\n"  # the image's workdir: the per-sample context
        await env.exec(["mkdir", "sub"])
        assert (await env.exec(["pwd"], cwd="sub")).stdout == "/testbed/sub\n"
        assert (await env.exec(["pwd"], cwd="/tmp", user="nobody")).stdout == "/tmp\n"
        assert (await env.exec(["sh", "-c", "echo $GREETING"], env={"GREETING": "hi there"})).stdout == "hi there\n"
        assert (await env.exec(["printf", "%s|", "a b", "$HOME;x"])).stdout == "a b|$HOME;x|"
        missing = await env.exec(["no-such-program"])
        assert missing.returncode == 127 and not missing.success
        with pytest.raises(TimeoutError):
            await env.exec(["sleep", "30"], timeout=1, timeout_retry=False)
        with pytest.raises(OutputLimitExceededError):
            await env.exec(["head", "-c", str(11 * 1024 * 1024), "/dev/zero"])

    _with_sandbox(check)


def test_files_text_bytes_errors_and_forks() -> None:
    async def check(env: Any) -> None:
        await env.write_file("deep/dir/a.txt", "line one\r\nline two\n")
        assert await env.read_file("deep/dir/a.txt") == "line one\r\nline two\n"
        assert (await env.exec(["cat", "/testbed/deep/dir/a.txt"])).stdout == "line one\r\nline two\n"
        await env.write_file("/tmp/b.bin", b"\x00\xff\x01")
        assert await env.read_file("/tmp/b.bin", text=False) == b"\x00\xff\x01"
        with pytest.raises(UnicodeDecodeError):
            await env.read_file("/tmp/b.bin")
        with pytest.raises(FileNotFoundError):
            await env.read_file("nope.txt")
        with pytest.raises(IsADirectoryError):
            await env.read_file("/tmp")
        with pytest.raises(IsADirectoryError):
            await env.write_file("/tmp", "x")
        await env.exec(["truncate", "-s", str(101 * 1024 * 1024), "/tmp/big"])
        with pytest.raises(OutputLimitExceededError):
            await env.read_file("/tmp/big")
        [child] = await env.fork(1)
        await child.write_file("deep/dir/a.txt", "the fork's")
        assert await child.read_file("deep/dir/a.txt") == "the fork's"
        assert await env.read_file("deep/dir/a.txt") == "line one\r\nline two\n"

    _with_sandbox(check)


def test_a_config_the_provider_cannot_run_is_refused() -> None:
    from pydantic import ValidationError

    from agentenv.harness.inspect_ai_sandbox import AgentenvSandboxConfig, parse_config

    with pytest.raises(ValueError, match="compose"):
        parse_config("compose.yaml")
    with pytest.raises(ValidationError):
        AgentenvSandboxConfig(image="agentenv/base", gpus=1)  # type: ignore[call-arg]
    assert parse_config("agentenv/base") == AgentenvSandboxConfig(image="agentenv/base")
