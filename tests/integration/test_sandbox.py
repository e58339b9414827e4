"""Sandbox basics on a real runc + Docker image: exec, streaming, files, spawn, timeouts, defaults."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import agentenv
from agentenv.errors import ImageNotFound, SandboxStateError

pytestmark = pytest.mark.integration


@pytest.fixture
def sb():
    with agentenv.Sandbox.create(memory="512m", cpus=1.0) as s:
        yield s


def test_exec_returns_code_output_and_cwd(sb):
    r = sb.exec("echo out; echo err >&2; pwd; exit 3")
    assert r.exit_code == 3 and not r.ok
    assert r.stdout == "out\n/testbed\n"
    assert r.stderr == "err\n"
    assert r.duration >= 0
    assert sb.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sb.exec("echo $FOO", env={"FOO": "bar"}).stdout == "bar\n"


def test_exec_streams_output_as_it_comes(sb):
    seen: list[tuple[str, bytes]] = []
    r = sb.exec("for i in 1 2 3; do echo $i; sleep 0.2; done; echo e >&2", on_output=lambda s, d: seen.append((s, d)))
    assert r.stdout == "1\n2\n3\n"
    out_chunks = [d for s, d in seen if s == "stdout"]
    assert len(out_chunks) >= 2, "output should arrive in pieces while the command runs"
    assert b"".join(out_chunks) == b"1\n2\n3\n"
    assert b"".join(d for s, d in seen if s == "stderr") == b"e\n"


def test_large_binary_output_and_files(sb):
    data = bytes(range(256)) * 4096  # 1 MiB, every byte value
    sb.write_file("/testbed/blob.bin", data, mode=0o600)
    assert sb.read_file("/testbed/blob.bin") == data
    assert sb.exec("stat -c %a /testbed/blob.bin").stdout.strip() == "600"
    assert sb.exec("head -c 3000000 /dev/zero | tr '\\0' x").stdout == "x" * 3_000_000
    sb.write_file("rel/dir/a.txt", "relative")
    assert sb.read_file("/testbed/rel/dir/a.txt") == b"relative"
    with pytest.raises(FileNotFoundError):
        sb.read_file("/nope/missing")


def test_timeout_kills_the_whole_process_group(sb):
    r = sb.exec("sleep 300 & (setsid sleep 301 &) ; sleep 302", timeout=1)
    assert r.timed_out and r.exit_code != 0
    left = sb.exec("ps -eo args | grep -c '^sleep 30[012]' || true").stdout.strip()
    assert left == "0", f"processes of the timed-out command survived: {left}"


def test_spawn_runs_in_background(sb):
    p = sb.spawn("for i in 1 2 3; do echo line$i; done; exit 7")
    assert p.wait(timeout=10) == 7
    assert p.output() == "line1\nline2\nline3\n"
    q = sb.spawn("sleep 100")
    assert q.exit_code is None
    q.kill()
    assert q.wait(timeout=10) == 128 + 9
    assert {x.pid for x in sb.processes()} >= {p.pid, q.pid}


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


def test_bad_input_is_rejected_with_typed_errors():
    with pytest.raises(ImageNotFound) as e:
        agentenv.Sandbox.create("no/such-image:latest")
    assert "agentenv/base:latest" in str(e.value)
    with pytest.raises(ValueError):
        agentenv.Sandbox.create(memory="lots")
    with pytest.raises(ValueError):
        agentenv.Sandbox.create(cpus=-1)
    assert agentenv.Sandbox.list() == []


def test_list_get_and_closed_state():
    s = agentenv.Sandbox.create(labels={"who": "test"})
    assert [x.id for x in agentenv.Sandbox.list()] == [s.id]
    again = agentenv.Sandbox.get(s.id)
    assert again.labels == {"who": "test"} and again.exec("echo hi").stdout == "hi\n"
    s.close()
    assert s.state == "closed"
    with pytest.raises(SandboxStateError):
        s.exec("true")
    assert agentenv.Sandbox.list() == []


def test_reattach_from_another_process():
    s = agentenv.Sandbox.create()
    try:
        s.write_file("/testbed/x", "from parent")
        code = f"import agentenv; print(agentenv.Sandbox.get('{s.id}').read_file('/testbed/x').decode())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "from parent"
    finally:
        s.close()
