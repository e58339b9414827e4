"""Signed file URLs (``Sandbox.download_url`` / ``upload_url``) in the hands of someone who holds the URL and
nothing else: the signature fixes the path, the operation and the account, so no header or body the holder adds
may read or write another path or act as another account."""

from __future__ import annotations

import httpx
import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import Sandbox  # noqa: E402

ROOT_BASIC = "Basic cm9vdDo="  # base64("root:"): envd's way of naming the account of a call


def test_a_url_signed_for_the_default_user_cannot_be_turned_into_roots(sandbox: Sandbox) -> None:
    sandbox.commands.run("echo -n topsecret > /root/secret.txt && chmod 600 /root/secret.txt", user="root")
    url = sandbox.download_url("/root/secret.txt")  # signed for the default account ("user" here): not readable
    assert httpx.get(url).status_code != 200
    forged = httpx.get(url, headers={"Authorization": ROOT_BASIC})
    assert forged.status_code == 401, forged.text
    assert "topsecret" not in forged.text
    up = sandbox.upload_url("/root/planted.txt")
    forged_up = httpx.post(up, files={"file": ("planted.txt", b"x")}, headers={"Authorization": ROOT_BASIC})
    assert forged_up.status_code == 401, forged_up.text
    assert not sandbox.files.exists("/root/planted.txt", user="root")


def test_a_write_url_signed_for_one_path_writes_that_path_alone(sandbox: Sandbox) -> None:
    url = sandbox.upload_url("/home/user/up.txt", "user")
    two = httpx.post(url, files=[("file", ("up.txt", b"one")), ("file", ("/home/user/other.txt", b"two"))])
    assert two.status_code == 400, two.text  # the second file's name is not the path signed
    assert not sandbox.files.exists("/home/user/other.txt")
    renamed = httpx.post(url, files={"file": ("/home/user/elsewhere.txt", b"three")})
    assert renamed.status_code == 200, renamed.text  # one file: the signed path names it, as envd
    assert sandbox.files.read("/home/user/up.txt") == "three"
    assert not sandbox.files.exists("/home/user/elsewhere.txt")
