"""Integration fixtures: a private agentenv home per test session, real Docker and CRIU, a leak check at the end."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import agentenv
from agentenv.cli.tour import ASK, COUNTER
from agentenv.host.trees import remove_tree

DOCKERD_LOG = "/var/log/agentenv-dockerd.log"


def _require(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.fail(f"{what} is not usable ({' '.join(cmd)}: {r.stderr.strip()[:200]}); run scripts/bootstrap.sh")


@pytest.fixture(scope="session", autouse=True)
def agentenv_home() -> Iterator[Path]:
    """Run every integration test against a fresh store and runc root, then check nothing leaked."""
    _require(["docker", "info"], "the Docker engine")
    _require(["criu", "check"], "CRIU")
    home = Path(tempfile.mkdtemp(prefix="agentenv-test-", dir="/var/tmp"))
    old = os.environ.get("AGENTENV_HOME")
    os.environ["AGENTENV_HOME"] = str(home)
    os.environ["AGENTENV_RESOLVE"] = "hosts"  # a host name in a network rule never sends a DNS query off the machine
    yield home
    try:
        leaks = leaked(home)
        assert not leaks, f"the test session leaked: {leaks}"
    finally:
        if old is None:
            os.environ.pop("AGENTENV_HOME", None)
        else:
            os.environ["AGENTENV_HOME"] = old
        cleanup(home)


def _image_layers(image: str) -> list[str]:
    """``image``'s Docker layer folders (none if the image or the engine is missing right now)."""
    from agentenv.host import images

    try:
        return images.resolve(image).layers
    except Exception:  # noqa: BLE001 - missing, or the engine restarting (a test does that): no census then
        return []


def _census(layers: list[str]) -> dict[str, int]:
    """How many entries each layer folder holds, read from the disk (not through the engine, which a test may be
    restarting)."""
    return {d: sum(len(dirs) + len(files) for _, dirs, files in os.walk(d)) for d in layers}


@pytest.fixture(scope="module", autouse=True)
def base_layers_intact() -> Iterator[None]:
    """Fail the module during which the default image's layers lost files on the Docker host: a delete that went
    through a mount into an image layer once did that unseen, and every later sandbox lacked python3."""
    from agentenv.api import DEFAULT_IMAGE

    layers = _image_layers(DEFAULT_IMAGE)
    before = _census(layers)
    yield
    after = _census(layers)
    lost = {d: (n, after.get(d, 0)) for d, n in before.items() if after.get(d, 0) < n}
    assert not lost, f"{DEFAULT_IMAGE}'s layers lost files during this module (entries before, after): {lost}"


@pytest.fixture(scope="session")
def ray_cluster(agentenv_home: Path) -> Iterator[Any]:
    """A head node and a second node (2 CPUs each) on this machine; the test process is a Ray driver of it.
    Started after ``agentenv_home`` so every Ray process shares the test session's sandbox home."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 128 << 20,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=2, object_store_memory=128 << 20)
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def leaked(home: Path) -> dict[str, list[str]]:
    """Containers, mounts, sandbox records, layers, snapshot files, sandboxes' network links (veths) and uid ranges
    still held (agentenv.host.userns) left under
    ``home`` (the volume's own mount, ``home/volume``, is the home's and stays until ``cleanup``)."""
    from agentenv.host import network

    runc = subprocess.run(["runc", "--root", str(home / "runc"), "list", "-q"], capture_output=True, text=True,
                          check=False).stdout.split()
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
              if line.split()[1].startswith(str(home)) and line.split()[1] != str(home / "volume")
              and not line.split()[1].startswith(f"{home}/uids/")]  # ranges' user namespaces, kept (userns_fd)

    def names(d: Path) -> list[str]:
        return sorted(p.name for p in d.iterdir() if p.name != ".lock") if d.exists() else []

    out = {
        "containers": runc,
        "mounts": mounts,
        "sandboxes": names(home / "sandboxes"),
        "layers": names(home / "volume" / "layers"),
        "snapshots": names(home / "snapshots") + names(home / "volume" / "snapshots"),
        "veths": sorted(network.links(f"{home}/")),
        "uid ranges held": sorted(p.name for p in (home / "uids").glob("*") if p.stat().st_nlink > 1)
        if (home / "uids").exists() else [],
    }
    return {k: v for k, v in out.items() if v}


def cleanup(home: Path) -> None:
    """Best-effort removal of everything under a test home (after the leak check has looked)."""
    for cid in subprocess.run(["runc", "--root", str(home / "runc"), "list", "-q"], capture_output=True,
                              text=True, check=False).stdout.split():
        subprocess.run(["runc", "--root", str(home / "runc"), "delete", "--force", cid], capture_output=True,
                       check=False)
    for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
        target = line.split()[1]
        if target.startswith(str(home)):
            subprocess.run(["umount", "-l", target], capture_output=True, check=False)
    from agentenv.host import network

    for veth in network.links(f"{home}/"):
        network.detach({"veth": veth})
    remove_tree(home)  # never through a mount the unmounts above missed (an image layer's)


def restart_dockerd() -> None:
    """Stop the Docker engine and start it again the way scripts/bootstrap.sh does."""
    managed = subprocess.run(["systemctl", "is-active", "docker"], capture_output=True, text=True,
                             check=False).stdout.strip() == "active" if shutil.which("systemctl") else False
    if managed:
        subprocess.run(["systemctl", "restart", "docker"], check=True)
    else:
        subprocess.run(["pkill", "-x", "dockerd"], check=False)
        for _ in range(200):
            if subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, check=False).returncode != 0:
                break
            time.sleep(0.1)
        with open(DOCKERD_LOG, "ab") as log:
            subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    for _ in range(300):
        if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("dockerd did not come back within 60 s")


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A file holding the test servers' bearer token (``server_fixtures.TOKEN``)."""
    from .server_fixtures import write_token_file

    return write_token_file(tmp_path)


@pytest.fixture(scope="module")
def e2b_url() -> Iterator[str]:
    """A server for the E2B SDKs, with their environment variables pointing at it (``server_fixtures.e2b_server``)."""
    from .server_fixtures import e2b_server

    with e2b_server() as url:
        yield url


@contextlib.contextmanager
def e2b_sandbox(cls: Any = None) -> Iterator[Any]:
    """A sandbox of the E2B SDK's ``cls`` (``e2b.Sandbox`` or a subclass, as the code interpreter's), killed after."""
    if cls is None:
        from e2b import Sandbox as cls
    sb = cls.create(timeout=600)
    try:
        yield sb
    finally:
        cls.kill(sb.sandbox_id)


def envd_token(sb: Any) -> str | None:
    """The envd access token of an E2B SDK sandbox, which the SDK keeps private (no public accessor): what a test
    sends as ``X-Access-Token`` on a raw request to envd. The one place the tests reach into the SDK for it."""
    return sb._envd_access_token  # noqa: SLF001


@pytest.fixture
def sandbox(e2b_url: str) -> Iterator[Any]:
    """An ``e2b.Sandbox`` on the module's E2B server, killed after the test (the E2B test files' sandbox)."""
    with e2b_sandbox() as sb:
        yield sb


# the tour's counter (agentenv.cli.tour): a number kept only in a TCP server's memory inside a sandbox, which the
# snapshot and fork tests start and ask, to see memory come back (or diverge) after a restore

def start_counter(sb: agentenv.Sandbox, detached: bool = False) -> None:
    """Start the counter server (``detached``: from an exec's shell with ``&``, which then exits); the probe that
    finds it up asks once, so it stands at 1."""
    sb.write_file("/opt/counter.py", COUNTER)
    if detached:
        sb.exec("nohup python3 /opt/counter.py >/dev/null 2>&1 &")
    else:
        sb.spawn("python3 /opt/counter.py")
    for _ in range(200):
        if sb.exec(ASK).exit_code == 0:
            return
        time.sleep(0.05)
    raise AssertionError("counter did not start")


def ask(sb: agentenv.Sandbox, times: int = 1) -> int:
    """Ask the counter ``times`` times; its last answer."""
    value = 0
    for _ in range(times):
        r = sb.exec(ASK)
        assert r.exit_code == 0, r.stderr
        value = int(r.stdout)
    return value
