"""Local-only sandbox behaviour; the rest runs against both the local and the remote API (test_api_contract.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import agentenv
from agentenv.errors import ImageNotFound

pytestmark = pytest.mark.integration


@pytest.fixture
def sb():
    with agentenv.Sandbox.create(memory="512m", cpus=1.0) as s:
        yield s


def test_large_output(sb):
    assert sb.exec("head -c 3000000 /dev/zero | tr '\\0' x").stdout == "x" * 3_000_000


def test_timeout_kills_the_whole_process_group(sb):
    r = sb.exec("sleep 300 & (setsid sleep 301 &) ; sleep 302", timeout=1)
    assert r.timed_out and r.exit_code != 0
    left = sb.exec("ps -eo args | grep -c '^sleep 30[012]' || true").stdout.strip()
    assert left == "0", f"processes of the timed-out command survived: {left}"


def test_concurrent_execs(sb):
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = sb.exec(f"sleep 0.{i % 3}; echo {i}").stdout

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n" for i in range(12)}


def test_safe_defaults(sb):
    status = sb.exec("cat /proc/self/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["NoNewPrivs"].strip() == "1"
    cap_eff = int(fields["CapEff"], 16)
    for cap in (21, 13, 12, 16, 19):  # SYS_ADMIN, NET_RAW, NET_ADMIN, SYS_MODULE, SYS_PTRACE
        assert not cap_eff & (1 << cap), f"capability {cap} must be dropped"
    ifaces = [ln.split(":")[0].strip() for ln in sb.exec("cat /proc/net/dev").stdout.splitlines()[2:]]
    assert ifaces == ["lo"], f"no network by default, found {ifaces}"
    assert sb.exec("test -e /var/run/docker.sock || test -e /run/docker.sock").exit_code != 0
    r = sb.exec("mount -t tmpfs none /mnt")
    assert r.exit_code != 0
    cg = Path("/sys/fs/cgroup/memory/agentenv") / f"ae-{sb.id}" / "memory.limit_in_bytes"
    if cg.exists():
        assert int(cg.read_text()) == 512 << 20
    pids = Path("/sys/fs/cgroup/pids/agentenv") / f"ae-{sb.id}" / "pids.max"
    if pids.exists():
        assert pids.read_text().strip() == "512"
    assert sb.limits.memory == 512 << 20


def test_memory_limit_is_enforced():
    with agentenv.Sandbox.create(memory="64m") as s:
        r = s.exec("python3 -c 'x = bytearray(200 << 20); print(len(x))'", timeout=60)
        assert r.exit_code != 0 and "209715200" not in r.stdout


def test_unknown_image_names_the_images_present():
    with pytest.raises(ImageNotFound) as e:
        agentenv.Sandbox.create("no/such-image:latest")
    assert "agentenv/base:latest" in str(e.value) and e.value.available
    assert agentenv.Sandbox.list() == []  # nothing half-made is left behind


def test_reattach_from_another_process():
    s = agentenv.Sandbox.create()
    try:
        s.write_file("/testbed/x", "from parent")
        code = f"import agentenv; print(agentenv.Sandbox.get('{s.id}').read_file('/testbed/x').decode())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "from parent"
    finally:
        s.close()


def test_sandbox_cannot_redirect_the_host_to_a_host_socket():
    """Replacing the agent's socket with a symlink to the Docker socket only breaks the sandbox."""
    with agentenv.Sandbox.create() as s:
        s.exec("rm /dev/agentenv/agent.sock && ln -s /run/docker.sock /dev/agentenv/agent.sock")
        with pytest.raises(agentenv.errors.ConnectionLost) as e:
            s.exec("true")
        assert "not a socket" in str(e.value)
