"""Benchmark the LLM gateway: its overhead per call against a direct call to the engine, at 1, 64 and 256 concurrent
sessions, its CPU per turn; and the fidelity figures against the real engine.

- ``overhead.c<C>.gateway`` / ``overhead.c<C>.direct``: per-call latency, C sessions at once, each playing
  ``--turns`` turns of an append-only tool conversation through the gateway (Chat Completions, not streamed; the
  gateway streams from the engine) against C callers sending the same turns' token ids straight to the engine's
  ``/v1/completions``. The engine is a stub (``rollout.scripted``, a fixed answer, no model) in its own process, and
  so is the gateway (``agentenv rollout gateway``): ``gateway_cpu_ms_per_turn`` is the gateway process's CPU time
  (``/proc/<pid>/stat``) over the turns it served. Ratio ``overhead.c<C>``: gateway over direct, medians.
- ``fidelity``: k3-mini served by our policy server with ``--echo`` (random weights), four sessions through the
  official SDKs (chat streamed and not, Anthropic streamed, Responses); the share of calls whose recorded prompt
  ids, sampled ids and logprobs equal a sequence of the engine's own record; the trainer's recomputed logprobs of
  the exported records against the recorded ones (max and mean |delta|); the merge rate; the branch causes.

Results go to ``bench/results/gateway.json``.

    .venv/bin/python -m bench.gateway [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness import Report, add_output_arg, console

HERE = Path(__file__).resolve().parent
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
    "command": {"type": "string"}}}}}]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stub_answer(text: str, turn: int) -> str:
    from rollout import scripted

    return "Running it." + scripted.tool_call("bash", {"command": f"echo {turn}"})


def serve_stub(port: int) -> None:
    """The stub engine (a child process of the benchmark)."""
    import uvicorn

    from rollout import scripted
    from rollout.agent import LocalTokenizer

    uvicorn.run(scripted.create_app(stub_answer, LocalTokenizer()), host="127.0.0.1", port=port, log_level="error")


def _wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode})")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} never answered")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _session_turns(client: httpx.AsyncClient, base: str, key: str, turns: int) -> list[float]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You run commands."},
                                      {"role": "user", "content": "Count to three."}]
    out = []
    for i in range(turns):
        t0 = time.perf_counter()
        r = await client.post(f"{base}/chat/completions", json={"model": "k3", "messages": messages, "tools": TOOLS},
                              headers={"Authorization": f"Bearer {key}"})
        out.append(time.perf_counter() - t0)
        r.raise_for_status()
        msg = r.json()["choices"][0]["message"]
        messages += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"{i}\n"}]
    return out


async def _direct_turns(client: httpx.AsyncClient, engine: str, prompts: list[list[int]]) -> list[float]:
    out = []
    for ids in prompts:
        t0 = time.perf_counter()
        r = await client.post(f"{engine}/v1/completions", json={"model": "scripted", "prompt": ids, "max_tokens": 256,
                                                                 "logprobs": 1, "return_token_ids": True})
        out.append(time.perf_counter() - t0)
        r.raise_for_status()
    return out


async def overhead(report: Report, concurrency: list[int], turns: int) -> None:
    engine_port, gw_port = _port(), _port()
    admin = "bench-admin-token"
    engine = subprocess.Popen([sys.executable, "-c", f"from bench.gateway import serve_stub; serve_stub({engine_port})"],
                              stderr=subprocess.DEVNULL)
    gw = subprocess.Popen([sys.executable, "-m", "agentenv", "rollout", "gateway", "--policy-url",
                           f"http://127.0.0.1:{engine_port}", "--port", str(gw_port)],
                          env={**os.environ, "AGENTENV_GATEWAY_TOKEN": admin}, stderr=subprocess.DEVNULL)
    engine_url, gw_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gw_port}"
    try:
        _wait(engine_url + "/v1/models", engine)
        _wait(gw_url + "/admin/sessions", gw)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            for c in concurrency:
                rounds = max(1, 64 // c)   # enough calls at low concurrency for a p99: rounds of c sessions
                opened, runs, failed, cpu = [], [], [], 0.0
                for _ in range(rounds):
                    batch = [(await client.post(f"{gw_url}/admin/sessions", json={}, headers={
                        "Authorization": f"Bearer {admin}"})).json() for _ in range(c)]
                    cpu0 = _cpu_s(gw.pid)
                    got = await asyncio.gather(*(_session_turns(client, o["openai_base_url"], o["key"], turns)
                                                 for o in batch), return_exceptions=True)
                    cpu += _cpu_s(gw.pid) - cpu0
                    for o, run in zip(batch, got, strict=True):
                        if isinstance(run, BaseException):
                            failed.append(f"{type(run).__name__}: {run}")
                        else:
                            opened.append(o)
                            runs.append(run)
                prompts = []
                for o in opened:   # the very prompts the gateway sent, from its records
                    closed = (await client.delete(f"{gw_url}/admin/sessions/{o['id']}",
                                                  headers={"Authorization": f"Bearer {admin}"})).json()
                    (record,) = closed["records"]
                    prompts.append([record["token_ids"][:t["start"]] for t in record["turns"]])
                direct = []   # the same turns straight to the engine, c sessions at once as through the gateway
                for at in range(0, len(prompts), c):
                    direct += await asyncio.gather(*(_direct_turns(client, engine_url, p) for p in prompts[at:at + c]))
                g, d = report.result(f"overhead.c{c}.gateway"), report.result(f"overhead.c{c}.direct")
                for s in (x for run in runs for x in run):
                    g.add(s)
                for s in (x for run in direct for x in run):
                    d.add(s)
                g.fields["gateway_cpu_ms_per_turn"] = round(1000 * cpu / max(1, len(runs) * turns), 3)
                g.fields["sessions_failed"] = len(failed)     # a connection the machine refused: counted, not hidden
                if failed:
                    g.note = f"{len(failed)} sessions failed, e.g. {failed[0][:200]}"
                report.add_ratio(f"overhead.c{c}", f"overhead.c{c}.gateway", f"overhead.c{c}.direct")
                gs, ds = g.stat, d.stat
                console.print(f"c={c}: gateway median {gs.median * 1e3 if gs else None:.1f} ms, direct "
                              f"{ds.median * 1e3 if ds else None:.1f} ms; gateway CPU "
                              f"{g.fields['gateway_cpu_ms_per_turn']} ms/turn")
    finally:
        for p in (gw, engine):
            p.terminate()
            p.wait(30)


def fidelity(report: Report) -> None:
    """The fidelity test's run, its figures kept (tests/integration/rollout/test_gateway_fidelity.py asserts them)."""
    code = ("import json, sys; sys.argv = ['pytest']; import pytest; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-s', "
            "'tests/integration/rollout/test_gateway_fidelity.py']))")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fidelity.json"
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AGENTENV_GATEWAY_FIGURES": str(out)},
                           capture_output=True, text=True, timeout=900, cwd=HERE.parent)
        if r.returncode != 0 or not out.exists():
            report.result("fidelity").fail(f"the fidelity run failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
            return
        report.info["fidelity"] = json.loads(out.read_text())
        console.print(f"fidelity: {report.info['fidelity']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 and 64 sessions, 2 turns each")
    ap.add_argument("--turns", type=int, default=4)
    add_output_arg(ap, "gateway")
    args = ap.parse_args()
    report = Report("gateway", {k: v for k, v in vars(args).items() if k != "output"})
    concurrency, turns = ([1, 64], 2) if args.quick else ([1, 64, 256], args.turns)
    asyncio.run(overhead(report, concurrency, turns))
    fidelity(report)
    console.print(f"wrote {report.write(args.output)}")


if __name__ == "__main__":
    main()
