"""JavaScript for the run_code kernel (``kernel.py``), where the sandbox's image has ``node``: standard library only.

A JavaScript context's kernel keeps one ``node`` child running :data:`NODE_SOURCE`: each request's code goes
to node's stdin as a JSON line and runs with ``vm.runInThisContext``, so what one request declares (``var``,
``let``, functions, required modules) the next one sees, as in a notebook; a returned Promise is awaited. Its
console writes to the kernel's fds 1 and 2, so it streams as the request's stdout and stderr; the value or the
exception comes back as a JSON line on a private pipe. Node is a process of the sandbox like the kernel, so a
fork or pause carries it (libuv's io_uring, which CRIU cannot dump, is turned off). An interrupt kills node:
the next request starts a fresh one, and says so.

In a sandbox this file runs joined to kernel.py (``kernel.launch``): its names are globals of that one module.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from typing import Any

FD_ENV = "AGENTENV_NODE_FD"
NODE_SOURCE = r"""
const vm = require('vm'), util = require('util'), fs = require('fs'), readline = require('readline');
const out = Number(process.env.AGENTENV_NODE_FD); delete process.env.AGENTENV_NODE_FD;
globalThis.require = require; globalThis.module = module; globalThis.exports = exports;
const send = (o) => fs.writeSync(out, JSON.stringify(o) + '\n');
const show = (v) => typeof v === 'string' ? v : util.inspect(v);
const rl = readline.createInterface({input: process.stdin, terminal: false});
let chain = Promise.resolve();
rl.on('line', (line) => { chain = chain.then(async () => {
  const req = JSON.parse(line), saved = {};
  for (const k of Object.keys(req.env)) { saved[k] = process.env[k]; process.env[k] = req.env[k]; }
  try {
    let v = vm.runInThisContext(req.code, {filename: '<cell>'});
    if (v && typeof v.then === 'function') v = await v;
    send(v === undefined ? {} : {text: show(v)});
  } catch (e) {
    const err = e instanceof Error ? e : new Error(show(e));
    send({name: err.name || 'Error', value: err.message || '', traceback: err.stack || String(err)});
  } finally {
    for (const k of Object.keys(saved)) { if (saved[k] === undefined) delete process.env[k]; else process.env[k] = saved[k]; }
  }
}); });
"""


class Node:
    """The ``node`` child of a JavaScript context, started on its first request."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.results = -1  # the read end of node's result pipe
        self.lost = False  # an interrupt killed node: its state is gone

    def start(self, request_env: dict[str, str]) -> None:
        r, w = os.pipe()  # the request's own variables are given per request (they end with it)
        env = {**{k: v for k, v in os.environ.items() if k not in request_env}, FD_ENV: str(w), "UV_USE_IO_URING": "0"}
        try:
            self.proc = subprocess.Popen(["node", "-e", NODE_SOURCE], stdin=subprocess.PIPE, pass_fds=(w,), env=env,
                                         start_new_session=True)
        finally:
            os.close(w)
        self.results = r

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            os.close(self.results)
        self.proc, self.lost = None, True

    def run(self, code: str, env: dict[str, str]) -> dict[str, Any]:
        """Run ``code`` (``env`` in ``process.env`` meanwhile): ``{}``, ``{"text": ...}`` for its value, or
        ``{"name", "value", "traceback"}``; ``restarted`` where an interrupt had killed the node before."""
        notice: dict[str, Any] = {}
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self.stop()
            if self.lost:
                notice = {"restarted": True}
            self.start(env)
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"code": code, "env": env}).encode() + b"\n")
            self.proc.stdin.flush()
            line = b""
            while not line.endswith(b"\n"):
                chunk = os.read(self.results, 1 << 16)
                if not chunk:
                    self.stop()
                    return {"name": "NodeExited", "value": "node exited; the next request starts a new one",
                            "traceback": "", **notice}
                line += chunk
        except BaseException:
            self.stop()  # interrupted mid-request: node's state cannot be trusted
            raise
        return {**json.loads(line), **notice}
