"""Images taken by a dataset's rule from a real registry: Debian's docker-registry on a loopback port (Docker treats
127.0.0.0/8 registries as insecure: no TLS), a small image pushed there under SWE-bench's name, pulled back through a
mirror prefix with progress; a `docker load` tarball; a registry that never answers stopped at the deadline; last
use recorded as sandboxes start; eviction, least recently used first, never of an image a sandbox stands on; and
prewarming two env servers through their route."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

import agentenv
from agentenv.errors import ImageUnavailable
from agentenv.host import image_store, images
from agentenv.host.image_store import ImageSources
from agentenv.remote.prewarm import prewarm
from envs.task import Task

from .server_fixtures import TOKEN, free_port, threaded_server, wait_for

pytestmark = pytest.mark.integration
REGISTRY = shutil.which("docker-registry")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``docker-registry serve`` on 127.0.0.1:<free port>, its storage in a temporary folder; yields HOST:PORT."""
    if REGISTRY is None:
        pytest.fail("docker-registry is not installed: run scripts/bootstrap.sh (it installs Debian's package)")
    folder = tmp_path_factory.mktemp("registry")
    port = free_port()
    (folder / "config.yml").write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {folder / 'data'}\n"
        f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([REGISTRY, "serve", str(folder / "config.yml")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            assert proc.poll() is None, f"docker-registry exited with {proc.returncode}"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "the registry answering /v2/")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def tiny_image(name: str) -> str:
    """A one-file image made offline (``docker import``): a few bytes to push and pull."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = f"{name}\n".encode()
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    repo, _, version = name.rpartition(":")
    images.docker_client().api.import_image_from_data(buf.getvalue(), repository=repo, tag=version)
    return str(images.inspect(name)["Id"])


def swe_bench_image(n: str) -> str:
    """The image a published SWE-bench record names by SWE-bench's rule (its ``image`` field absent)."""
    t = Task.from_json({"repo": "demo/demo", "instance_id": f"demo__demo-{n}", "base_commit": "a" * 40,
                        "patch": "--- a/x\n+++ b/x\n", "problem_statement": "p", "version": "1.0",
                        "FAIL_TO_PASS": '["t.py::t"]', "PASS_TO_PASS": "[]"})
    assert t.dataset == "swe-bench"
    return t.image


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Image names a test makes; every one removed after (never anyone else's)."""
    made: list[str] = []
    yield made
    for n in made:
        images.remove(n)


def pushed(registry: str, names: list[str]) -> str:
    """A SWE-bench-named image in the registry (under the mirror prefix) and not on this host; its name."""
    n = uuid.uuid4().hex[:8]
    name = swe_bench_image(n)
    names.append(name)
    ref = image_store.mirror_ref(name, registry)
    tiny_image(ref)
    names.append(ref)
    subprocess.run(["docker", "push", "-q", ref], check=True, capture_output=True, timeout=120)
    images.remove(ref)
    assert not images.present(name) and not images.present(ref)
    return name


def test_a_dataset_image_comes_from_a_mirror_with_progress_and_its_use_is_recorded(registry, names):
    name = pushed(registry, names)
    assert name.startswith("swebench/sweb.eval.x86_64.demo_1776_demo-") and name.endswith(":latest")
    said: list[str] = []
    got = image_store.ensure(name, ImageSources(mirrors=(registry,), deadline=120), say=said.append)
    assert (got.image, got.source, got.detail) == (name, "mirror", f"{registry}/{name}")
    assert images.present(name) and not images.present(f"{registry}/{name}")  # tagged as asked, mirror tag gone
    assert any(line.startswith(f"[pull] {registry}/") for line in said), said  # the pull's own progress lines
    assert image_store.ensure(name, ImageSources()).source == "local"  # the local store first, no pull
    [me] = [i for i in image_store.usage().images if i.id == got.id]
    assert me.fetched == f"mirror {registry}/{name}" and me.last_used is not None and name in me.tags


def test_no_source_is_a_clear_error_naming_the_image_and_what_to_do(registry, names, tmp_path):
    name = swe_bench_image(uuid.uuid4().hex[:8])
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(ImageUnavailable) as e:
        image_store.ensure(name, ImageSources(mirrors=(closed,), tarballs=str(tmp_path), pull=True, deadline=60))
    text = str(e.value)
    assert name in text and f"mirror {closed}/{name}" in text and f"no {image_store.tarball_name(name)}.tar" in text
    assert "AGENTENV_IMAGE_TARBALLS" in text and "AGENTENV_IMAGE_MIRRORS" in text
    with pytest.raises(ImageUnavailable, match="pulls are off"):
        image_store.ensure(name, ImageSources(pull=False))


def test_a_pull_from_a_registry_that_never_answers_stops_at_the_deadline(names):
    """A listener that accepts and never answers: the engine would wait on it; the deadline stops the pull."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    try:
        mirror = f"127.0.0.1:{silent.getsockname()[1]}"
        name = swe_bench_image(uuid.uuid4().hex[:8])
        with pytest.raises(ImageUnavailable, match=r"did not finish within 3 s"):
            image_store.ensure(name, ImageSources(mirrors=(mirror,), deadline=3.0))
        assert held, "the engine never reached the silent registry"
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        silent.close()


def test_a_tarball_is_loaded_by_the_images_name(names, tmp_path):
    name = f"agentenv-test/tarball-{uuid.uuid4().hex[:8]}:v1"
    names.append(name)
    tiny_image(name)
    subprocess.run(["docker", "save", "-o", str(tmp_path / f"{image_store.tarball_name(name)}.tar"), name],
                   check=True, timeout=120)
    images.remove(name)
    got = image_store.ensure(name, ImageSources(tarballs=str(tmp_path), pull=False))
    assert got.source == "tarball" and images.present(name)
    other = f"agentenv-test/other-{uuid.uuid4().hex[:8]}:v1"
    os.rename(tmp_path / f"{image_store.tarball_name(name)}.tar", tmp_path / f"{image_store.tarball_name(other)}.tar")
    with pytest.raises(ImageUnavailable, match=f"holds {name}, not {other}"):
        image_store.ensure(other, ImageSources(tarballs=str(tmp_path), pull=False))


def test_eviction_takes_the_least_recently_used_and_never_what_a_sandbox_stands_on(names, tmp_path):
    tag = uuid.uuid4().hex[:8]
    old, new = f"agentenv-test/old-{tag}:v1", f"agentenv-test/new-{tag}:v1"
    held = f"agentenv-test/held-{tag}:v1"
    names += [old, new, held]
    ids = {n: tiny_image(n) for n in (old, new)}
    (tmp_path / "Dockerfile").write_text(f"FROM agentenv/base\nLABEL agentenv.test={tag}\nRUN echo {tag} > /held\n")
    images.build(str(tmp_path), held)
    ids[held] = str(images.inspect(held)["Id"])
    for n, when in ((held, 1_000_000_000), (old, 1_100_000_000), (new, 1_200_000_000)):
        image_store.record_use(ids[n], [n], fetched="registry")  # as ensure() records what it fetched
        os.utime(image_store._use_file(ids[n]), (when, when))  # uses long ago, in a known order
    with agentenv.Sandbox.create(held, memory="256m") as sb:
        assert image_store._use_file(ids[held]).stat().st_mtime > time.time() - 3600  # the start is a use
        os.utime(image_store._use_file(ids[held]), (900_000_000, 900_000_000))  # the oldest of all again
        budget = image_store.usage().total - 1  # one byte must go
        assert [i.id for i in image_store.evict(budget, dry_run=True)] == [ids[old]]
        removed = image_store.evict(budget)
        assert [i.tags for i in removed] == [(old,)]
        assert images.present(held) and images.present(new) and not images.present(old)
        assert sb.exec("cat /held").stdout == f"{tag}\n"
        mine = {i.id: i for i in image_store.usage().images}
        assert mine[ids[held]].held_by == f"sandbox {sb.id}" and mine[ids[new]].held_by is None


def test_prewarm_makes_two_servers_ensure_every_image_with_progress(registry, names, tmp_path, capsys):
    name = pushed(registry, names)
    absent = swe_bench_image(uuid.uuid4().hex[:8])
    seen: list[tuple[str, int, int]] = []
    with threaded_server(max_sandboxes=2, image_mirrors=[registry], pull_deadline=120) as a, \
            threaded_server(max_sandboxes=2, image_mirrors=[registry], pull_deadline=120) as b:
        got = prewarm([a, b], TOKEN, [name, "agentenv/base", absent], deadline=60,
                      on_progress=lambda w, done, total: seen.append((w.image, done, total)))
        by = {(w.url, w.image): w for w in got}
        assert len(got) == 6 and [d for _, d, _ in seen] == list(range(1, 7)) and {t for *_, t in seen} == {6}
        # both servers stand on this host's one Docker engine: whichever came first pulled it
        assert {by[(a, name)].source, by[(b, name)].source} <= {"mirror", "local"} and images.present(name)
        assert by[(a, "agentenv/base")].source == "local"
        for url in (a, b):
            assert not by[(url, absent)].ok and absent in by[(url, absent)].error
            assert f"mirror {registry}/{absent}" in by[(url, absent)].error
        # the task set's command: its images on the servers named, a line per image as each is done
        from envs.tasks.__main__ import main

        (tmp_path / "token").write_text(TOKEN)
        record = {"repo": "demo/demo", "instance_id": name.split(".")[-1].split(":")[0].replace("_1776_", "__"),
                  "base_commit": "a" * 40, "patch": "--- a/x\n+++ b/x\n", "problem_statement": "p",
                  "version": "1.0", "FAIL_TO_PASS": '["t.py::t"]', "PASS_TO_PASS": "[]"}
        assert Task.from_json(record).image == name
        (tmp_path / "tasks.jsonl").write_text(json.dumps(record) + "\n")
        assert main(["prewarm", "--tasks", str(tmp_path / "tasks.jsonl"), "--url", a, "--url", b,
                     "--token-file", str(tmp_path / "token")]) == 0
        out = capsys.readouterr().out
        assert "[prewarm 2/2]" in out and "2/2 image(s) on their servers" in out
        with agentenv.connect(a, TOKEN) as client:
            usage = client.request("GET", "/v1/images")
            assert usage["total"] > 0 and any(name in i["tags"] for i in usage["images"])
            with pytest.raises(ValueError):
                client.ensure_image("Not An Image!")
