"""The tour: every sandbox primitive once, timed — create, a stateful process, snapshot, fork 4 ways,
the children diverging, pause/resume, and a restore by a fresh process after the owner exited."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from rich.console import Console
from rich.table import Table

from agentenv.sandbox.core import Sandbox
from agentenv.snapshot.store import Snapshot
from agentenv.terminal import clean, markup

T = TypeVar("T")
console = Console()

# A counter that lives only in the memory of a TCP server inside the sandbox.
COUNTER = """
import socket
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 7000)); srv.listen(16)
n = 0
while True:
    c, _ = srv.accept(); n += 1; c.sendall(str(n).encode()); c.close()
"""
ASK = "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', 7000), timeout=5).recv(64).decode())\""


class Timer:
    """Records how long each step took, for the closing table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float]] = []

    def __call__(self, label: str, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        with console.status(label):
            out = fn()
        dt = time.perf_counter() - t0
        self.rows.append((label, dt))
        console.print(f"  [green]✓[/] {label:<52} [bold]{dt * 1000:8.1f} ms[/]")
        return out

    def table(self) -> Table:
        t = Table(title="where the time went")
        t.add_column("operation")
        t.add_column("ms", justify="right")
        for label, dt in self.rows:
            t.add_row(label, f"{dt * 1000:.1f}")
        return t


def ask(sb: Sandbox) -> int:
    r = sb.exec(ASK)
    if r.exit_code != 0:
        raise RuntimeError(f"counter did not answer in {sb.id}: {clean(r.stderr)}")
    return int(r.stdout)


def run(image: str = "agentenv/base") -> None:
    """Run the tour; every sandbox and snapshot it makes is removed at the end."""
    timer = Timer()
    console.rule("[bold]agentenv tour")
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    try:
        sb = timer("create a sandbox", lambda: Sandbox.create(image, cpus=1.0, memory="512m"))
        made.append(sb)
        timer("exec round trip (true)", lambda: sb.exec("true"))
        sb.write_file("/opt/counter.py", COUNTER)
        sb.spawn("python3 /opt/counter.py")
        while sb.exec(ASK).exit_code != 0:
            time.sleep(0.02)
        for _ in range(4):
            ask(sb)
        console.print(f"  counter server running in {sb.id}, value {ask(sb)}")
        snap = timer("memory snapshot (every process)", lambda: sb.snapshot(memory=True))
        snaps.append(snap)
        fs = timer("filesystem snapshot", lambda: sb.snapshot(memory=False))
        snaps.append(fs)
        kids = timer("fork(4): four children running", lambda: sb.fork(4))
        made.extend(kids)
        values = {}
        for i, k in enumerate(kids):
            for _ in range(i + 1):
                values[k.id] = ask(k)
        values[sb.id] = ask(sb)
        t = Table(title="children continue from the snapshot (value 6), then diverge")
        t.add_column("sandbox")
        t.add_column("asked")
        t.add_column("counter", justify="right")
        for i, k in enumerate(kids):
            t.add_row(f"child {i} {k.id}", f"{i + 1}×", str(values[k.id]))
        t.add_row(f"parent {sb.id}", "1×", str(values[sb.id]))
        console.print(t)
        timer("pause child 0 (state to the store)", kids[0].pause)
        timer("resume child 0", kids[0].resume)
        console.print(f"  child 0 after resume: counter {ask(kids[0])}")
        code = (f"import time, agentenv; t = time.perf_counter(); sb = agentenv.Sandbox.restore({snap.id!r});"
                f"dt = time.perf_counter() - t; print(sb.id, dt)")
        out = timer("restore from a fresh process (incl. its start)",
                    lambda: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True))
        rid, dt = out.stdout.split()
        restored = Sandbox.get(rid)
        made.append(restored)
        console.print(f"  restored {markup(rid)} in {float(dt) * 1000:.1f} ms inside that process; counter {ask(restored)}")
        console.print(timer.table())
    finally:
        for s in made:
            s.close()
        for snap_ in snaps:
            snap_.delete()
    console.print("[bold green]tour done[/]: every sandbox and snapshot it made is gone")
