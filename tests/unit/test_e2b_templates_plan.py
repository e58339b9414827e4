"""E2B templates without Docker: the SDK's steps as typed steps, E2B's errors for failing steps, what a COPY takes
from its upload (never unpacked on the host), the template records (names, tags, builds) and the template routes up to the build itself (upload links, signatures)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("e2b", reason="the E2B SDK is an extra; bootstrap installs it")

from e2b import Template  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from agentenv.host.archives import UnsafeArchive  # noqa: E402
from agentenv.server.e2b import template_build as tb  # noqa: E402
from agentenv.server.e2b import template_copy as tc  # noqa: E402
from agentenv.server.e2b import template_plan as tp  # noqa: E402
from agentenv.server.e2b import template_store as store  # noqa: E402

from .conftest import TOKEN  # noqa: E402

KEY = {"X-API-KEY": TOKEN}


def _steps(template: object) -> list[dict[str, object]]:
    """The steps the SDK sends for ``template`` (its own serialisation, files hashed)."""
    data = json.loads(Template.to_json(template))  # type: ignore[arg-type]
    return list(data["steps"])


def test_steps_become_typed_steps(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("x")
    t = (Template(file_context_path=str(tmp_path)).from_image("agentenv/base")
         .copy("d/f.txt", "/app/", user="nobody", mode=0o600).copy("d", "/data")
         .set_envs({"A": 'q"uote\\d', "B": "2"}).set_workdir("/app").set_user("nobody")
         .run_cmd("echo hi", user="root").run_cmd("ls"))
    p = tp.plan(_steps(t))
    hashes = [s["filesHash"] for s in _steps(t)[:2]]
    assert p.steps == [("1", tp.Copy("d/f.txt", "/app/", "nobody", 0o600, hashes[0])),
                       ("2", tp.Copy("d", "/data", "", None, hashes[1])),
                       ("3", tp.SetEnv((("A", 'q"uote\\d'), ("B", "2")))), ("4", tp.Workdir("/app")),
                       ("5", tp.SetUser("nobody")), ("6", tp.Run("echo hi", "root")), ("7", tp.Run("ls", None))]
    assert p.user == "nobody"


def test_a_command_with_line_breaks_and_quotes_stays_one_step() -> None:
    cmd = "cat <<EOF > /x\nit's \"here\"\nEOF"
    p = tp.plan([{"type": "RUN", "args": [cmd]}])
    assert p.user is None  # no set_user: the template names no user
    assert p.steps == [("1", tp.Run(cmd, None))]


@pytest.mark.parametrize("step, message", [
    ({"type": "COPY", "args": ["../etc/passwd", "/x"], "filesHash": "ab" * 32}, "inside the file context"),
    ({"type": "COPY", "args": ["/etc/passwd", "/x"], "filesHash": "ab" * 32}, "inside the file context"),
    ({"type": "COPY", "args": ["a", "/x"]}, "needs its filesHash"),
    ({"type": "COPY", "args": ["a", "/x", "", "rwx"], "filesHash": "ab" * 32}, "not an octal file mode"),
    ({"type": "ENV", "args": ["1BAD", "v"]}, "not an environment variable name"),
    ({"type": "ENV", "args": ["K", "line\nbreak"]}, "line break"),
    ({"type": "WORKDIR", "args": ["/a\nRUN evil"]}, "line break"),
    ({"type": "RUN", "args": []}, "missing its arguments"),
    ({"type": "ADD", "args": ["x"]}, "unknown step type"),
])
def test_steps_that_cannot_be_built_are_refused(step: dict[str, object], message: str) -> None:
    with pytest.raises(store.TemplateRefused, match=message):
        tp.plan([step])


def test_variables_expand_as_docker_expands_them() -> None:
    env = {"WHO": "world", "EMPTY": ""}
    assert tp.expand('say "hi" \\ $WHO', env) == 'say "hi" \\ world'
    assert tp.expand("${WHO}s ${NONE:-fallback} ${EMPTY:-e} ${WHO:+set} ${NONE:+x}. $5 $", env) == \
        "worlds fallback e set . $5 $"
    assert tp.within("/opt/app", "sub/") == "/opt/app/sub/" and tp.within("/a", "../b") == "/b"
    assert tp.within("/a", "/") == "/"


def test_failures_name_the_step_as_e2b_does() -> None:
    failed = tp.run_failed("apt-get update", 100, False, 60, 1 << 30)
    assert failed.startswith("failed to run command 'apt-get update': exit status 100")
    assert "no package registry is reachable" in failed
    assert "did not finish within 60 s" in tp.run_failed("sleep 99", -1, True, 60, 1 << 30)
    assert "memory limit of 512 MiB" in tp.run_failed("python3 big.py", 137, False, 60, 512 << 20)
    assert tp.no_such_user("root123", "whoami") == ("failed to run command 'whoami': command failed: "
                                                   "unauthenticated: invalid username: 'root123'")
    assert "invalid username: 'ghost'" in tp.no_such_user("ghost", None) and "useradd" in tp.no_such_user("g", None)


def test_base_image_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    with pytest.raises(tb.StepFailed, match="registry credentials") as e:
        tb.base_image({"fromImage": "x", "fromImageRegistry": {"type": "registry"}}, print)
    assert e.value.step == "base"
    with pytest.raises(tb.StepFailed, match="template 'nope' not found"):
        tb.base_image({"fromTemplate": "nope"}, print)
    assert tb.base_image({"fromTemplate": "base"}, print) == "agentenv/base"


def test_records_names_tags_and_what_a_sandbox_starts_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    rec, b1, tags = store.request("app:v1", ["stable"], 1.0, 1 << 30)
    assert tags == ["v1", "stable"] and store.find("app") == store.find(rec["id"])
    with pytest.raises(store.TemplateRefused, match="no ready build tagged 'default'"):
        store.for_sandbox("app")
    store.update(rec["id"], b1, status="ready", image="img:1", snapshot=None, user="root")
    assert store.for_sandbox("app:stable") == store.Target("img:1", None, 1.0, 1 << 30, "root")
    rec2, b2, _ = store.request("app", ["stable"], 2.0, 2 << 30)
    assert rec2["id"] == rec["id"]
    store.update(rec["id"], b2, status="error", reason={"message": "boom", "step": "1"})
    assert store.for_sandbox("app:stable").image == "img:1"  # a failed rebuild leaves the tags as they were
    store.update(rec["id"], b2, status="ready", image="img:2", snapshot="snap-x", user="nobody")
    assert store.for_sandbox("app") == store.Target("img:2", "snap-x", 2.0, 2 << 30, "nobody")
    assert store.assign("app:v1", ["prod"]) == (b1, ["prod"])
    assert store.for_sandbox("app:prod").image == "img:1"
    for bad in (":invalid", "app:"):
        with pytest.raises(store.TemplateRefused, match="invalid tag"):
            store.assign("app:v1", [bad])
    store.unassign("app", ["prod"])
    with pytest.raises(store.TemplateNotFound):
        store.unassign("app", ["prod"])
    assert store.for_sandbox("agentenv/base") is None and store.for_sandbox("base") is None
    for name in ("base", "snap-1", "Bad Name"):
        with pytest.raises(store.TemplateRefused):
            store.request(name, [], 1.0, 1 << 30)
    written = json.loads((tmp_path / "e2b-templates" / "templates" / f"{rec['id']}.json").read_text())
    assert set(written["builds"]) == {b1, b2}
    assert not list((tmp_path / "e2b-templates" / "templates").glob(".*.tmp"))  # written by rename


def test_a_build_of_a_dead_server_reads_as_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    rec, b, _ = store.request("app", [], 1.0, 1 << 30)
    store.update(rec["id"], b, status="building", pid=2 ** 22 + 1)  # beyond pid_max: no such process
    assert store.build_of(store.load(rec["id"]), b)["status"] == "error"


def test_logs_page_by_offset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    b = "00000000-0000-0000-0000-000000000001"
    for i in range(150):
        store.log(b, f"line {i}", "error" if i == 149 else "info")
    assert [e["message"] for e in store.logs(b, 0)][-1] == "line 99"
    assert [e["message"] for e in store.logs(b, 100)][0] == "line 100" and len(store.logs(b, 100)) == 50
    assert store.logs(b, 150) == [] and [e["message"] for e in store.logs(b, 0, level="error")] == ["line 149"]


def _archive(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_routes_up_to_the_build(client: TestClient) -> None:
    assert client.get("/templates/aliases/base", headers=KEY).status_code == 200
    assert client.get("/templates/aliases/mine", headers=KEY).status_code == 404
    assert client.post("/v3/templates", json={"name": "mine"}).status_code == 401
    r = client.post("/v3/templates", json={"name": "mine:v1", "tags": ["t"], "cpuCount": 1, "memoryMB": 512},
                    headers=KEY)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["names"] == ["mine"] and body["tags"] == ["v1", "t"]
    tid, bid = body["templateID"], body["buildID"]
    assert client.get("/templates/aliases/mine", headers=KEY).json()["templateID"] == tid
    assert client.post("/v3/templates", json={"name": "x", "teamID": "t"}, headers=KEY).status_code == 400

    h = "ab" * 32
    link = client.get(f"/templates/{tid}/files/{h}", headers=KEY)
    assert link.status_code == 201 and link.json()["present"] is False
    url = link.json()["url"]
    assert url.startswith(str(client.base_url)) and "signature=" in url
    forged = url.replace("signature=", "signature=0")
    assert client.put(forged, content=_archive("a.txt", b"x")).status_code == 403
    other = url.replace(h, "cd" * 32)
    assert client.put(other, content=_archive("a.txt", b"x")).status_code == 403  # signed for one hash only
    assert client.put(url, content=b"not a tar").status_code == 400
    assert client.put(url, content=_archive("a.txt", b"x")).status_code == 200
    assert client.get(f"/templates/{tid}/files/{h}", headers=KEY).json()["present"] is True

    bad = client.post(f"/v2/templates/{tid}/builds/{bid}", headers=KEY,
                      json={"fromImage": "img", "steps": [{"type": "COPY", "args": ["../x", "/y"], "filesHash": h}]})
    assert bad.status_code == 400 and "inside the file context" in bad.json()["message"]
    extra = client.post(f"/v2/templates/{tid}/builds/{bid}", headers=KEY, json={"fromImage": "img", "mcp": 1})
    assert extra.status_code == 400 and "mcp" in extra.json()["message"]
    status = client.get(f"/templates/{tid}/builds/{bid}/status", headers=KEY).json()
    assert status["status"] == "waiting" and status["logEntries"] == []
    assert client.get(f"/templates/{tid}/tags", headers=KEY).json() == []  # tags come with a ready build
    assert client.get(f"/templates/{tid}/builds/00000000-0000-0000-0000-000000000000/status",
                      headers=KEY).status_code == 404
    ok = client.post(f"/v2/templates/{tid}/builds/{bid}", headers=KEY,
                     json={"fromTemplate": "none-such", "steps": [{"type": "COPY", "args": ["a.txt", "/y"],
                                                                   "filesHash": h}]})
    assert ok.status_code == 202  # its thread fails at once (no such base template, no Docker asked)
    assert client.post(f"/v2/templates/{tid}/builds/{bid}", headers=KEY, json={"fromImage": "img"}).status_code == 409
    assert client.delete(f"/templates/{tid}", headers=KEY).status_code == 204
    assert client.get(f"/templates/{tid}/files/{h}", headers=KEY).status_code == 404  # the template is gone
    assert not store.file_path(h).exists()  # and the upload it alone copied
    assert client.get("/templates/aliases/mine", headers=KEY).status_code == 404
    assert client.delete("/templates/nothing-here", headers=KEY).status_code == 404


def _upload(path: Path, members: list[tuple[str, bytes, str]]) -> Path:
    """A tar of (name, type, data or link target) members."""
    with tarfile.open(path, "w") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.mode = kind, 0o644
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = data
                tar.addfile(info)
            else:
                body = data.encode()
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body) if kind == tarfile.REGTYPE else None)
    return path


def test_a_copy_takes_what_docker_would_and_never_unpacks_on_the_host(tmp_path: Path) -> None:
    up = _upload(tmp_path / "up.tar", [
        ("folder", tarfile.DIRTYPE, ""), ("folder/a.txt", tarfile.REGTYPE, "a"), ("folder/sub", tarfile.DIRTYPE, ""),
        ("folder/sub/b.txt", tarfile.REGTYPE, "b"), ("folder/.hidden", tarfile.REGTYPE, "h"),
        ("folder/dangling", tarfile.SYMTYPE, "nowhere"), ("folder/abs", tarfile.SYMTYPE, "/etc/passwd"),
        ("folder/same", tarfile.LNKTYPE, "folder/a.txt"), ("top.txt", tarfile.REGTYPE, "t")])

    def placed(src: str, mode: int | None = None) -> tuple[bool, dict[str, tuple[bytes, str, int]]]:
        buf = io.BytesIO()
        single = tc.write(up, src, mode, buf, 1 << 20)
        buf.seek(0)
        with tarfile.open(fileobj=buf) as tar:
            return single, {m.name: (tar.extractfile(m).read() if m.isreg() else b"", m.linkname,  # type: ignore[union-attr]
                                     m.mode) for m in tar}

    single, files = placed("folder/*", 0o755)
    assert not single and sorted(files) == [".hidden", "a.txt", "abs", "b.txt", "dangling", "same"]  # a folder's
    assert files["same"] == (b"a", "", 0o755)  # a hard link is a file of its own; the mode on files only
    assert files["abs"][1] == "/etc/passwd" and files["abs"][2] == 0o644  # a link is copied as written
    single, files = placed("folder")
    assert not single and "sub/b.txt" in files and "sub" in files
    assert placed("top.txt") == (True, {"top.txt": (b"t", "", 0o644)})
    with pytest.raises(tc.NothingToCopy, match="no files match"):
        placed("nothing/*")
    with pytest.raises(tc.NothingToCopy, match="not in the files uploaded"):
        placed("missing.txt")


def test_an_upload_with_a_device_node_or_an_escape_is_refused(tmp_path: Path) -> None:
    for i, (kind, name, link) in enumerate(((tarfile.CHRTYPE, "dev", ""), (tarfile.REGTYPE, "../../escape", ""),
                                            (tarfile.LNKTYPE, "shadow", "/etc/shadow"))):
        up = _upload(tmp_path / f"{i}.tar", [(name, kind, link)])
        with pytest.raises(UnsafeArchive, match=name.replace(".", r"\.")):
            tb.check_upload(up)
        with pytest.raises(UnsafeArchive, match=name.replace(".", r"\.")):
            tc.write(up, name.lstrip("./"), None, io.BytesIO(), 1 << 20)
    assert not (tmp_path / "escape").exists()


def test_a_copy_bigger_than_the_builds_disk_is_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    """A small upload whose hard links each become a copy (or a compressed one) would fill the host's scratch disk:
    what a copy places is counted against the build's disk before anything is written."""
    links = [(f"l{i}", tarfile.LNKTYPE, "big") for i in range(64)]
    up = _upload(tmp_path / "bomb.tar", [("big", tarfile.REGTYPE, "x" * 4096), *links])
    out = io.BytesIO()
    with pytest.raises(tc.TooLarge, match=r"266240 bytes .* more than the build's disk of 65536 bytes"):
        tc.write(up, "*", None, out, 64 << 10)
    assert out.getvalue() == b""
    tc.write(up, "*", None, out, 65 * 4096)  # exactly what it holds fits
