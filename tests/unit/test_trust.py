"""The transfer key and the seal of a manifest (``agentenv.snapshot.trust``), without Docker: the home's key is made
once (0600) and reused, a key file others may read or too short is refused saying what to do, a seal checks with
its key only, and ``agentenv serve`` refuses a bad --transfer-key before it starts."""

from __future__ import annotations

import stat

import pytest
from typer.testing import CliRunner

from agentenv.cli import app
from agentenv.errors import TransferError, UntrustedSnapshot
from agentenv.snapshot import trust


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    yield tmp_path / "home"
    trust.configure(None)


def test_the_homes_key_is_made_once_private_and_seals_what_it_checks(home):
    sealed = trust.seal({"id": "snap-x", "digests": ["a" * 64]})
    key = home / trust.HOME_KEY
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_text().strip()) == 64
    before = key.read_text()
    trust.verify(sealed, "here")
    assert key.read_text() == before and sealed["key_id"] == trust.key_id(trust.key())
    with pytest.raises(UntrustedSnapshot, match="does not match its seal"):
        trust.verify({**sealed, "digests": ["b" * 64]}, "here")
    with pytest.raises(UntrustedSnapshot, match="another key .*same key file"):
        trust.verify(trust.seal(sealed, b"k" * 32), "there")


def test_a_key_file_is_the_servers_alone_and_long_enough(home, tmp_path, monkeypatch):
    f = tmp_path / "shared.key"
    f.write_text("k" * 40)
    f.chmod(0o640)
    monkeypatch.setenv(trust.KEY_ENV, str(f))
    with pytest.raises(TransferError, match="chmod 600"):
        trust.seal({"id": "snap-x"})
    with pytest.raises(ValueError, match="chmod 600"):
        trust.configure(f)
    f.chmod(0o600)
    f.write_text("short\n")
    with pytest.raises(ValueError, match="fewer than 32"):
        trust.configure(f)
    with pytest.raises(ValueError, match="cannot be read"):
        trust.configure(tmp_path / "missing")
    f.write_text("k" * 40 + "\n")
    trust.configure(f)
    assert trust.key() == b"k" * 40 and not (home / trust.HOME_KEY).exists()  # the file named, not the home's


def test_serve_refuses_a_transfer_key_others_may_read(home, tmp_path):
    f = tmp_path / "shared.key"
    f.write_text("k" * 40)
    f.chmod(0o644)
    token = tmp_path / "token"
    token.write_text("t" * 30)
    r = CliRunner().invoke(app, ["serve", "--token-file", str(token), "--transfer-key", str(f), "--port", "1"])
    assert r.exit_code == 2 and "chmod 600" in r.output
