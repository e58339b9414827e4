"""How many sandboxes this machine holds at once: idle ones (running, answering), and paused ones (files only).

Idle: sandboxes of ``agentenv/base`` are created one after another, each doing nothing after its start, until
something refuses one (its error is where agentenv stopped), the host's available memory falls to ``--floor``
(where this benchmark stopped, to keep the machine alive), ``--minutes`` pass, ``--max`` is reached, or a
SIGINT. Each new sandbox answers ``exec`` before the next is made; at the end every tenth is asked again. Host
memory per idle sandbox is the fall of ``MemAvailable`` divided by the count. Creates and closes per second are
reported for the first and the last 100 (with few and with nearly all held): their ratio is 1.0 where nothing
per sandbox grows with the count. The plain alternative, in the same run: ``--docker`` idle
``docker run -d agentenv/base sleep infinity`` containers, measured the same way.

Paused: a sandbox is created and paused with its files only (``pause(memory=False)``: no process left, its layer
in the snapshot store), again and again, until a refusal, the volume's free space falls under ``--disk-floor``,
``--paused-minutes`` pass or ``--max-paused``. Reported: the count, the volume's bytes per paused sandbox, and how
a resume of one answers.

Everything runs in a private $AGENTENV_HOME with the local API (no server quotas in the way) and is removed after.

    .venv/bin/python -m bench.capacity [--max 2000] [--floor 3g] [--max-paused 2000] [--paused-minutes 10] [--docker 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv.config import parse_size
from bench.harness import Report, Result, Row, add_output_arg, console, print_table
from bench.server import drop_home

IMAGE = "agentenv/base"


def mem_available() -> int:
    """The host's MemAvailable, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def cgroup_memory(rel: Path) -> int:
    """Memory charged to the cgroup at ``rel`` (v2 memory.current, else v1 memory.usage_in_bytes); 0 if none."""
    root = Path("/sys/fs/cgroup")
    for f in (root / rel / "memory.current", root / "memory" / rel / "memory.usage_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            return int(f.read_text())
    return 0


def docker_cgroup(cid: str) -> Path:
    """A Docker container's cgroup relative to the hierarchy's root (cgroupfs' driver, else systemd's)."""
    for rel in (Path("docker") / cid, Path("system.slice") / f"docker-{cid}.scope"):
        if cgroup_memory(rel):
            return rel
    return Path("docker") / cid


def free_disk(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


WINDOW = 100  # sandboxes per window of the create and close rates at low and at high counts


def rates(samples: list[float]) -> dict[str, Any]:
    """Operations per second over the first and the last ``WINDOW`` of ``samples`` (one after another, in the
    order they ran), their ratio (last / first: 1.0 when nothing per operation grows with the count), and the rate
    of every whole window in order."""
    if len(samples) < 2 * WINDOW:
        return {}
    first, last = WINDOW / sum(samples[:WINDOW]), WINDOW / sum(samples[-WINDOW:])
    every = [round(WINDOW / sum(samples[i:i + WINDOW]), 2) for i in range(0, len(samples) - WINDOW + 1, WINDOW)]
    return {"first_per_s": round(first, 2), "last_per_s": round(last, 2), "last_over_first": round(last / first, 3),
            "per_window_per_s": every}


def fill(made: list[Any], r: Result, what: str, cap: int, then: Callable[[Any], object],
         floor_reached: Callable[[], str | None]) -> tuple[list[Any], str]:
    """Sandboxes made one after another into ``made`` (each timed into ``r`` with ``then(sb)``) until
    ``floor_reached`` says why to stop, agentenv refuses one, or ``cap``; returns them and where it stopped."""
    import agentenv

    while len(made) < cap:
        why = floor_reached()
        if why is not None:
            return made, why
        t = time.perf_counter()
        try:
            sb = agentenv.Sandbox.create(IMAGE)
            made.append(sb)
            then(sb)
        except KeyboardInterrupt:
            return made, f"the operator (SIGINT) at {len(made)}"
        except Exception as e:  # noqa: BLE001 - where agentenv stopped is the result
            return made, f"agentenv refused {what} {len(made) + 1}: {type(e).__name__}: {str(e)[:300]}"
        r.add(time.perf_counter() - t)
        if len(made) % 100 == 0:
            console.print(f"  {len(made)} x {what}, {mem_available() >> 20} MiB available", highlight=False)
    return made, f"the cap of {cap}"


def idle(made: list[Any], report: Report, cap: int, floor: int, minutes: float) -> None:
    """Idle sandboxes until a refusal, the memory floor or ``cap``; returns them (still running)."""
    r = report.result("idle.create", "create -> exec answered, one after another")
    base = mem_available()
    t0 = time.monotonic()
    deadline = time.monotonic() + minutes * 60

    def floor_reached() -> str | None:
        if mem_available() < floor:
            return f"the benchmark's memory floor ({floor >> 20} MiB available left)"
        return f"the benchmark's time limit ({minutes:g} min)" if time.monotonic() > deadline else None

    made, stop = fill(made, r, "idle sandbox", cap, lambda sb: sb.exec("true"), floor_reached)
    t_end = time.monotonic()
    used = base - mem_available()
    asked = made[::10]
    answered = 0
    for sb in asked:
        with contextlib.suppress(Exception):  # one that does not answer is counted as such
            answered += sb.exec("echo ok").stdout == "ok\n"
    charged = sum(cgroup_memory(Path(sb.lifecycle.container.cgroup.lstrip("/"))) for sb in made)
    report.info["idle"] = {"count": len(made), "stopped_by": stop, "host_bytes_used": used,
                           "host_bytes_per_sandbox": used // max(1, len(made)),
                           "cgroup_bytes_per_sandbox": charged // max(1, len(made)),
                           "asked_again": len(asked), "answered_again": answered,
                           "seconds": round(t_end - t0, 1),
                           "create_rate": rates(r.samples)}  # first 100 made with 0..99 held, last with N-100..N-1


def docker_idle(report: Report, n: int) -> None:
    """The plain alternative: ``n`` idle Docker containers, measured the same way (and removed)."""
    if n <= 0 or shutil.which("docker") is None:
        return
    r = report.result("docker.run", "docker run -d ... sleep infinity -> docker exec true, one after another")
    base = mem_available()
    ids: list[str] = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            out = subprocess.run(["docker", "run", "-d", "--network", "none", IMAGE, "sleep", "infinity"],
                                 capture_output=True, text=True, timeout=120, check=True)
            ids.append(out.stdout.strip())
            subprocess.run(["docker", "exec", ids[-1], "true"], capture_output=True, timeout=60, check=True)
            r.add(time.perf_counter() - t)
        used = base - mem_available()
        charged = sum(cgroup_memory(docker_cgroup(c)) for c in ids)
        report.info["docker_idle"] = {"count": len(ids), "host_bytes_used": used,
                                      "host_bytes_per_container": used // max(1, len(ids)),
                                      "cgroup_bytes_per_container": charged // max(1, len(ids))}
    except (subprocess.SubprocessError, OSError) as e:
        r.fail(e)
    finally:
        for i in range(0, len(ids), 50):
            subprocess.run(["docker", "rm", "-f", *ids[i:i + 50]], capture_output=True, timeout=300, check=False)


def paused(made: list[Any], report: Report, home: Path, cap: int, disk_floor: int, minutes: float) -> None:
    """Files-only paused sandboxes until a refusal, the disk floor, ``minutes`` or ``cap``; one is resumed at the
    end."""
    r = report.result("paused.create_pause", "create -> pause(memory=False), one after another")
    vol = home / "volume"
    start: list[int] = []
    deadline = time.monotonic() + minutes * 60
    t0 = time.monotonic()

    def disk_floor_reached() -> str | None:
        if time.monotonic() > deadline:
            return f"the benchmark's time limit ({minutes:g} min)"
        if not vol.exists():
            return None
        free = free_disk(vol)
        start[:] = start or [free]
        return f"the benchmark's disk floor ({disk_floor >> 20} MiB free left on the volume)" \
            if free < disk_floor else None

    made, stop = fill(made, r, "paused sandbox", cap, lambda sb: sb.pause(memory=False), disk_floor_reached)
    used = start[0] - free_disk(vol) if start and vol.exists() else 0
    resumed = report.result("paused.resume", "resume of a files-only paused sandbox -> exec answered")
    if made:
        t = time.perf_counter()
        try:
            made[0].resume()
            made[0].exec("true")
            resumed.add(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - recorded
            resumed.fail(e)
    report.info["paused"] = {"count": len(made), "stopped_by": stop, "volume_bytes_used": used,
                             "volume_bytes_per_sandbox": used // max(1, len(made)),
                             "volume_bytes_free": free_disk(vol) if vol.exists() else None,
                             "seconds": round(time.monotonic() - t0, 1), "create_pause_rate": rates(r.samples)}


def close_all(sandboxes: list[Any], r: Result | None = None) -> None:
    """Close each of ``sandboxes`` (each timed into ``r``; progress every 200; one that fails is reported), then
    forget them."""
    for i, sb in enumerate(sandboxes):
        t = time.perf_counter()
        try:
            sb.close()
            if r is not None:
                r.add(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - reported, the rest still go
            console.print(f"[yellow]could not close {sb.id}: {e}[/yellow]", highlight=False)
        if i and i % 200 == 0:
            console.print(f"  closed {i} of {len(sandboxes)}", highlight=False)
    sandboxes.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--max", type=int, default=2000, help="idle sandboxes at most")
    ap.add_argument("--floor", default="3g", help="stop making idle sandboxes when MemAvailable falls to this")
    ap.add_argument("--minutes", type=float, default=10, help="stop making idle sandboxes after this long")
    ap.add_argument("--max-paused", type=int, default=2000, help="paused sandboxes at most")
    ap.add_argument("--disk-floor", default="2g", help="stop pausing when the volume has this little free")
    ap.add_argument("--paused-minutes", type=float, default=10, help="stop pausing sandboxes after this long")
    ap.add_argument("--docker", type=int, default=20, help="idle Docker containers for the comparison (0: none)")
    add_output_arg(ap, "capacity")
    args = ap.parse_args(argv)
    report = Report("capacity", {k: v for k, v in vars(args).items() if k != "output"})
    home = Path(tempfile.mkdtemp(prefix="agentenv-bench-capacity-", dir="/var/tmp"))
    saved = os.environ.get("AGENTENV_HOME")
    os.environ["AGENTENV_HOME"] = str(home)
    made: list[Any] = []  # closed whatever ends the run (an interrupt too): none outlives its home
    try:
        docker_idle(report, args.docker)
        idle(made, report, args.max, parse_size(args.floor), args.minutes)
        closes = report.result("idle.close", "close of an idle sandbox, the most recent first")
        close_all(made[::-1], closes)  # the first closes leave N-1.. held, the last ones 99..0
        made.clear()
        if "idle" in report.info:
            report.info["idle"]["close_rate"] = rates(closes.samples)
        paused(made, report, home, args.max_paused, parse_size(args.disk_floor), args.paused_minutes)
    except Exception as e:  # noqa: BLE001 - recorded, the report is still written
        report.fatal = f"{type(e).__name__}: {e}"
    finally:
        close_all(made)
        if saved is None:
            os.environ.pop("AGENTENV_HOME", None)
        else:
            os.environ["AGENTENV_HOME"] = saved
        drop_home(home)
    idle_info, dock = report.info.get("idle", {}), report.info.get("docker_idle", {})
    x = None
    if idle_info.get("host_bytes_per_sandbox", 0) > 0 and dock.get("host_bytes_per_container", 0) > 0:
        x = idle_info["host_bytes_per_sandbox"] / dock["host_bytes_per_container"]
        report.info["memory_ratio_sandbox_per_container"] = round(x, 3)
    else:
        report.notes.append("no memory ratio: a MemAvailable fall was not positive (other load on the machine)")
    print_table("one after another, ms (ratio = host memory per idle sandbox / per idle Docker container)", [
        Row("idle sandbox: create -> exec", [report.results.get("idle.create")], x),
        Row("idle Docker container: run -> exec", [report.results.get("docker.run")]),
        Row("idle sandbox: close", [report.results.get("idle.close")]),
        Row("files-only pause: create -> pause", [report.results.get("paused.create_pause")]),
        Row("resume of one -> exec", [report.results.get("paused.resume")])])
    for key, what in (("idle", "create_rate"), ("idle", "close_rate"), ("paused", "create_pause_rate")):
        got = report.info.get(key, {}).get(what)
        if got:
            console.print(f"{key} {what}: {got['first_per_s']}/s for the first {WINDOW}, {got['last_per_s']}/s for "
                          f"the last {WINDOW} (x{got['last_over_first']})", highlight=False)
    for key in ("idle", "docker_idle", "paused"):
        if key in report.info:
            console.print(f"{key}: {report.info[key]}", highlight=False)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal else 0


if __name__ == "__main__":
    raise SystemExit(main())
