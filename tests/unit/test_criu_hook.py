"""CRIU's setup-namespaces action served by the restoring process (restore.NamespaceHook), run as CRIU would run it."""

from __future__ import annotations

import os
import subprocess

import pytest

from agentenv.snapshot.restore import NamespaceHook


def _run(hook: NamespaceHook, action: str, pid: int = 4242) -> int:
    env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": action, "CRTOOLS_INIT_PID": str(pid)}
    return subprocess.run([str(hook.script)], env=env, timeout=30, check=False).returncode


def test_the_action_hands_the_restored_init_to_setup_and_waits_for_it(tmp_path):
    seen: list[int] = []
    hook = NamespaceHook(tmp_path, seen.append)
    try:
        assert _run(hook, "pre-restore") == 0 and seen == []  # every other action passes straight through
        assert _run(hook, "setup-namespaces", 4242) == 0
    finally:
        hook.close()
    assert seen == [4242] and hook.error is None


def test_a_failed_setup_fails_the_action_and_is_kept_for_the_caller(tmp_path):
    def setup(pid: int) -> None:
        raise OSError(1, "no veth for you")

    hook = NamespaceHook(tmp_path, setup)
    try:
        assert _run(hook, "setup-namespaces") != 0
    finally:
        hook.close()
    assert isinstance(hook.error, OSError) and "veth" in str(hook.error)


@pytest.mark.parametrize("runs", [0, 1])
def test_close_returns_whether_or_not_criu_got_to_the_action(tmp_path, runs):
    """A restore that failed before the action leaves the hook's thread waiting: close wakes it."""
    hook = NamespaceHook(tmp_path, lambda pid: None)
    for _ in range(runs):
        _run(hook, "post-restore")
    hook.close()
    assert hook.error is None
