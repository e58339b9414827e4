"""The ``e2b`` SDK's envd 0.6.x file features against a real ``agentenv serve``: file metadata (``user.e2b.*``
xattrs in the sandbox), signed file URLs, watch events as envd gives them, and envd's folder and symlink info."""

from __future__ import annotations

import httpx
import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import FileType, Sandbox  # noqa: E402
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType  # noqa: E402

from .conftest import envd_token  # noqa: E402

XATTR = "python3 -c \"import os, sys; print(os.getxattr(sys.argv[1], 'user.e2b.' + sys.argv[2]).decode())\""


def test_metadata_is_stored_in_the_sandbox_as_xattrs_and_follows_the_file(sandbox: Sandbox) -> None:
    info = sandbox.files.write("meta/a.txt", "one", metadata={"Author": "mish", "purpose": "upload"})
    assert info.metadata == {"author": "mish", "purpose": "upload"}  # keys lowercased, as envd
    path = sandbox.commands.run("realpath meta/a.txt").stdout.strip()
    assert sandbox.commands.run(f"{XATTR} {path} author").stdout == "mish\n"  # a real xattr, read inside
    assert sandbox.commands.run(f"stat -c %U {path}").stdout == "user\n"  # written as the account
    assert next(e for e in sandbox.files.list("meta") if e.name == "a.txt").metadata == info.metadata
    moved = sandbox.files.rename("meta/a.txt", "meta/b.txt")
    assert moved.metadata == info.metadata
    assert sandbox.files.write("meta/b.txt", "two").metadata is None  # an overwrite clears the old set
    assert sandbox.files.get_info("meta/b.txt").metadata is None
    sandbox.commands.run(f"python3 -c \"import os; os.setxattr('{path[:-5]}b.txt', 'user.e2b.k', b'v')\"")
    assert sandbox.files.get_info("meta/b.txt").metadata == {"k": "v"}


def test_metadata_the_server_refuses_is_a_400_and_writes_nothing(sandbox: Sandbox) -> None:
    url = f"{sandbox.envd_api_url}/files"
    headers = {"X-Access-Token": envd_token(sandbox) or "", "E2b-Sandbox-Id": sandbox.sandbox_id,
               "X-Metadata-k": "x" * 5000}
    r = httpx.post(url, params={"path": "/tmp/big.txt", "username": "user"}, content=b"x",
                   headers={**headers, "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "metadata" in r.json()["message"]
    assert not sandbox.files.exists("/tmp/big.txt")


def test_signed_urls_open_files_of_their_sandbox_alone(sandbox: Sandbox) -> None:
    sandbox.files.write("signed.txt", "secret")
    url = sandbox.download_url("signed.txt", "user")
    r = httpx.get(url)  # no header names the sandbox: the signature does
    assert (r.status_code, r.text) == (200, "secret")
    assert httpx.get(sandbox.download_url("signed.txt", "user", 120)).text == "secret"
    expired = httpx.get(sandbox.download_url("signed.txt", "user", use_signature_expiration=-120))
    assert (expired.status_code, expired.json()) == (401, {"code": 401, "message": "signature is already expired"})
    tampered = url.replace("signed.txt", "other.txt", 1)
    assert httpx.get(tampered).status_code == 401 and "invalid signature" in httpx.get(tampered).text
    assert httpx.post(url, files={"file": ("signed.txt", b"x")}).status_code == 401  # a read signature, a write
    up = httpx.post(sandbox.upload_url("up.txt", "user"), files={"file": ("up.txt", b"uploaded")})
    assert up.status_code == 200, up.text
    assert sandbox.files.read("up.txt") == "uploaded"
    signed_query = url.split("?", 1)[1]
    rpc = httpx.post(f"{sandbox.envd_api_url}/filesystem.Filesystem/Stat?{signed_query}", json={"path": "/"},
                     headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "Content-Type": "application/json"})
    assert rpc.status_code == 401  # a signature opens /files alone
    other = Sandbox.create(timeout=120)
    try:
        named = httpx.get(url, headers={"E2b-Sandbox-Id": other.sandbox_id})  # another sandbox named: not its token
        assert named.status_code == 401
        assert httpx.get(url, headers={"E2b-Sandbox-Id": sandbox.sandbox_id}).text == "secret"
    finally:
        Sandbox.kill(other.sandbox_id)


def test_watch_events_carry_entries_and_show_envds_chown_of_uploads(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("w")
    handle = sandbox.files.watch_dir("w", include_entry=True, allow_network_mounts=True)
    sandbox.files.write("w/up.txt", "data")
    events = handle.get_new_events()
    assert [(e.name, e.type) for e in events] == [("up.txt", FilesystemEventType.CREATE),
                                                  ("up.txt", FilesystemEventType.CHMOD),
                                                  ("up.txt", FilesystemEventType.WRITE)]
    assert all(e.entry is not None and e.entry.path.endswith("/w/up.txt") and e.entry.type == FileType.FILE
               for e in events)
    sandbox.commands.run("echo hi > w/cmd.txt")  # a command's file: no chown, so no CHMOD
    assert [e.type for e in handle.get_new_events() if e.name == "cmd.txt"] == [FilesystemEventType.CREATE,
                                                                              FilesystemEventType.WRITE]
    sandbox.commands.run("rm w/cmd.txt")
    gone = [e for e in handle.get_new_events() if e.name == "cmd.txt"]
    assert [e.type for e in gone] == [FilesystemEventType.REMOVE] and gone[0].entry is None
    handle.stop()


def test_folder_size_and_symlink_type_as_envd(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("d")
    assert sandbox.files.get_info("d").size > 0 and sandbox.files.get_info("d").size % 4096 == 0
    sandbox.files.write("d/t.txt", "x")
    sandbox.commands.run("ln -s t.txt d/link")
    link = sandbox.files.get_info("d/link")
    assert link.type == FileType.FILE and link.symlink_target is not None
    assert link.symlink_target.endswith("/d/t.txt")


def test_metadata_survives_pause_and_fork(sandbox: Sandbox) -> None:
    sandbox.files.write("kept.txt", "x", metadata={"stage": "before"})
    assert sandbox.pause() is True
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.files.get_info("kept.txt").metadata == {"stage": "before"}
    kids = again.fork(count=1)
    try:
        assert kids[0].files.get_info("kept.txt").metadata == {"stage": "before"}  # the layer's clone has it
        kids[0].files.write("kept.txt", "y", metadata={"stage": "child"})
        assert again.files.get_info("kept.txt").metadata == {"stage": "before"}
    finally:
        for kid in kids:
            kid.kill()
