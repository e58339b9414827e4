"""A sandbox's life as E2B's SDK (2.63) sees it, against a real ``agentenv serve``: what a command stream ends
with when its sandbox is killed under it, and (below) what wakes a paused sandbox."""

from __future__ import annotations

import asyncio

import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import AsyncSandbox, Sandbox  # noqa: E402
from e2b.exceptions import SandboxNotRunningException  # noqa: E402


def test_a_command_whose_sandbox_is_killed_ends_saying_so(e2b_url: str) -> None:
    """The stream breaks as the agent dies, before the kill is through; the SDK then asks /health, which must
    say the sandbox is gone (runc's word, not the record's), so the error names the kill."""
    async def flow() -> None:
        sb = await AsyncSandbox.create()
        try:
            cmd = await sb.commands.run("sleep 60", background=True)
            await sb.kill()
            with pytest.raises(SandboxNotRunningException, match="killed or reached its end of life"):
                await cmd.wait()
            assert not await sb.is_running()
        finally:
            await AsyncSandbox.kill(sb.sandbox_id)

    asyncio.run(flow())


def test_health_answers_for_a_running_sandbox(sandbox: Sandbox) -> None:
    assert sandbox.is_running()
