"""The E2B adapter's pure parts: access tokens, watch diffs, error codes, command lines (no Docker, no server)."""

from __future__ import annotations

import pytest

pytest.importorskip("e2b", reason="the E2B SDK is an extra; bootstrap installs it")

from connectrpc.code import Code  # noqa: E402
from e2b.envd.filesystem import filesystem_pb as fpb  # noqa: E402

from agentenv import errors  # noqa: E402
from agentenv.api import FileInfo, JobInfo  # noqa: E402
from agentenv.server.e2b.bridge import connect_error  # noqa: E402
from agentenv.server.e2b.files import DIR_BLOCK, Uploads, changes, entry, http_error  # noqa: E402
from agentenv.server.e2b.process import _config  # noqa: E402
from agentenv.server.e2b.tokens import HEADERS, envd_token, presented, sent, traffic_token  # noqa: E402


def test_access_tokens_are_per_sandbox_per_server_and_per_kind() -> None:
    envd, traffic = envd_token("server-token", "sb-1"), traffic_token("server-token", "sb-1")
    assert len({envd, traffic, envd_token("server-token", "sb-2"), envd_token("other-token", "sb-1"),
                traffic_token("server-token", "sb-2")}) == 5
    both = ("envd", "traffic")
    assert presented({HEADERS["envd"]: envd.encode()}, "server-token", "sb-1", both) == "envd"
    assert presented({HEADERS["traffic"]: traffic.encode()}, "server-token", "sb-1", both) == "traffic"
    # each token in its own header only, for its own sandbox only
    for headers, kinds in (({HEADERS["envd"]: traffic.encode()}, both), ({HEADERS["traffic"]: envd.encode()}, both),
                           ({HEADERS["traffic"]: traffic.encode()}, ("envd",)), ({HEADERS["envd"]: b""}, both)):
        assert presented(headers, "server-token", "sb-1", kinds) is None
        assert sent(headers) == bool(headers[next(iter(headers))])
    assert presented({HEADERS["envd"]: envd.encode()}, "server-token", "sb-2", both) is None


def _info(name: str, kind: str, size: int, mtime: float, mode: int, metadata: dict[str, str] | None = None) -> FileInfo:
    return FileInfo(name=name, path=f"/w/{name}", type=kind, size=size, mode=mode, permissions="", owner="u",
                    group="u", modified=mtime, metadata=metadata)


def test_watch_diffs() -> None:
    old = {"a": _info("a", "file", 1, 1.0, 0o644), "gone": _info("gone", "file", 1, 1.0, 0o644),
           "mode": _info("mode", "file", 1, 1.0, 0o644), "d": _info("d", "dir", 0, 1.0, 0o755),
           "meta": _info("meta", "file", 1, 1.0, 0o644)}
    new = {"a": _info("a", "file", 2, 2.0, 0o644), "mode": _info("mode", "file", 1, 1.0, 0o600),
           "d": _info("d", "dir", 0, 3.0, 0o755), "fresh": _info("fresh", "file", 5, 4.0, 0o644),
           "empty": _info("empty", "file", 0, 4.0, 0o644), "meta": _info("meta", "file", 1, 1.0, 0o644, {"k": "v"})}
    got = {(e.name, e.type) for e in changes(old, new)}
    E = fpb.EventType
    assert got == {("a", E.WRITE), ("mode", E.CHMOD), ("fresh", E.CREATE), ("fresh", E.WRITE),
                   ("empty", E.CREATE), ("gone", E.REMOVE), ("meta", E.CHMOD)}
    assert changes(new, new) == []
    assert all(not e.has_field("entry") for e in changes(old, new))


def test_a_file_written_through_files_shows_envds_chown_between_create_and_write() -> None:
    uploads = Uploads()
    fresh = _info("fresh", "file", 5, 4.0, 0o644)
    uploads.add("sb", fresh)
    E = fpb.EventType
    got = changes({}, {"fresh": fresh}, lambda i: uploads.made("sb", i), with_entry=True)
    assert [e.type for e in got] == [E.CREATE, E.CHMOD, E.WRITE]
    assert all(e.entry.path == "/w/fresh" for e in got)
    later = _info("fresh", "file", 6, 5.0, 0o644)  # changed since by something else: a plain write
    assert [e.type for e in changes({"fresh": fresh}, {"fresh": later}, lambda i: uploads.made("sb", i))] == [E.WRITE]
    assert not uploads.made("other-sandbox", fresh)


def test_entries_give_folder_sizes_in_blocks_and_metadata() -> None:
    assert entry(_info("d", "dir", 0, 1.0, 0o755)).size == DIR_BLOCK
    assert entry(_info("d", "dir", DIR_BLOCK + 1, 1.0, 0o755)).size == 2 * DIR_BLOCK
    assert entry(_info("f", "file", 0, 1.0, 0o644)).size == 0
    linked = entry(FileInfo(name="l", path="/w/l", type="file", size=3, mode=0o644, permissions="", owner="u",
                            group="u", modified=1.0, symlink_target="/w/f", metadata={"a": "b"}))
    assert not linked.is_symlink and linked.type == fpb.FileType.FILE and linked.symlink_target == "/w/f"
    assert dict(linked.metadata) == {"a": "b"}


@pytest.mark.parametrize(("exc", "code", "status"), [
    (FileNotFoundError(2, "no"), Code.NOT_FOUND, 404),
    (ProcessLookupError("no"), Code.NOT_FOUND, 404),
    (FileExistsError(17, "there"), Code.ALREADY_EXISTS, 409),
    (PermissionError(13, "no"), Code.PERMISSION_DENIED, 403),
    (ValueError("bad"), Code.INVALID_ARGUMENT, 400),
    (errors.SandboxNotFound("gone"), Code.UNAVAILABLE, 502),
    (OSError(28, "No space left on device"), Code.INTERNAL, 507),
    (RuntimeError("bug"), Code.INTERNAL, 500),
])
def test_errors_become_the_codes_the_sdk_branches_on(exc: Exception, code: Code, status: int) -> None:
    assert connect_error(exc).code == code
    assert http_error(exc).status_code == status


def test_listed_commands_show_the_line_they_were_started_with() -> None:
    job = JobInfo(pid=7, command="/bin/bash -l -c 'echo hi; sleep 1'", cwd=None, env={}, tag=None, stdin=False,
                  exit_code=None)
    cfg = _config(job)
    assert (cfg.cmd, list(cfg.args)) == ("/bin/bash", ["-l", "-c", "echo hi; sleep 1"])
    odd = _config(JobInfo(pid=8, command="echo 'unbalanced", cwd=None, env={}, tag=None, stdin=False, exit_code=None))
    assert (odd.cmd, list(odd.args)) == ("/bin/sh", ["-c", "echo 'unbalanced"])
