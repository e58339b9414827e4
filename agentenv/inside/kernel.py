"""A persistent Python interpreter inside a sandbox: the back end of e2b's ``Sandbox.run_code``.

Like ``keeper.py`` it runs with the sandbox's own python3 and the standard library only, and it treats its
sandbox as hostile. The host starts it with :func:`launch` (the source travels in an environment variable,
so no file is needed in the sandbox), writes :func:`request` lines to its stdin and cuts its stdout into
events with :func:`split_events`: exactly the NDJSON objects of e2b's ``/execute`` stream (``stdout``,
``stderr``, ``result``, ``error``, ``number_of_executions``), each tagged with the request's ``id``, then
``{"type": "end", "id": ...}``. Globals persist across requests, the last expression is the main result,
SIGINT interrupts the running request. The protocol channel is private: fds 0, 1 and 2 become /dev/null and
two pipes drained into stdout/stderr events, so neither user code nor its subprocesses can corrupt it.
IPython's lines (``!cmd``, ``%pip``, ``%cd``, ``%env``, ``%%bash``) and bash requests come from ``magics.py``,
JavaScript requests from ``nodejs.py``, what a value, a figure or an error shows as from ``results.py``.

Chosen over IPython in the image (issue 26, ``bench/kernel.py``): both survive fork and pause under CRIU, but
IPython's bare shell takes 4-6x as long to its first result (0.5-0.7 s against 0.1-0.2 s), and must be in every image.
"""

from __future__ import annotations

import ast
import builtins
import codecs
import contextlib
import datetime
import json
import linecache
import os
import re
import select
import signal
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

from agentenv.inside.magics import MAGIC, Magics, Shell, transform
from agentenv.inside.nodejs import Node
from agentenv.inside.results import INLINE_BACKEND, InlineBackend, error_text, figures, formats

ENV_NAME = "AGENTENV_KERNEL"  # carries the source; the loader pops it, so user code never inherits it
MAX_LINE = 64 << 20  # bytes of one request line; a longer one is answered with an error and skipped
MAX_ENV = 128 << 10  # the kernel's limit on one environment string (MAX_ARG_STRLEN)
READ_CHUNK = 1 << 20  # bytes read from stdin at a time
PIPE_READ = 1 << 16  # bytes of one stdout/stderr event at most
MAX_DRAIN = 1024  # reads of one drain: a process writing without pause cannot hold a request open forever
LANGUAGES = ("python", "bash", "javascript")  # Python cells, bash scripts (``magics.Shell``), node (``nodejs``)
PARTS = ("magics", "nodejs", "results", "kernel")  # the files of the kernel, joined in this order (``source``)
_CO_COROUTINE = 0x80  # a cell with top-level await compiles to a coroutine
_LOADER = f'import os;exec(compile(os.environ.pop("{ENV_NAME}"),"<kernel>","exec"))'
_ID = re.compile(rb'^\s*\{\s*"id"\s*:\s*("(?:[^"\\]|\\.){0,256}")')  # the id of a line too long to parse
_write, _dumps, _loads = os.write, json.dumps, json.loads  # bound once: user code may patch the modules


# ---- host side ----

def source() -> str:
    """The kernel as one module: its ``PARTS`` in order, their import of each other and ``from __future__``
    lines taken out (the sandbox has no agentenv package to import from)."""
    parts = []
    for path in [os.path.join(os.path.dirname(__file__), f"{name}.py") for name in PARTS]:
        with open(path, encoding="utf-8") as f:
            text = f.read().replace("from __future__ import annotations\n", "")
        parts.append(re.sub(r"^from agentenv\.inside\.\w+ import [^\n]*\n", "", text, flags=re.M))
    return "from __future__ import annotations\n" + "\n".join(parts)


def launch() -> tuple[str, dict[str, str]]:
    """The ``/bin/sh -c`` command line that starts the kernel in a sandbox, and the variables it needs."""
    source_ = source()
    if len(ENV_NAME) + 1 + len(source_.encode()) >= MAX_ENV:
        raise RuntimeError(f"the kernel does not fit in one environment variable ({MAX_ENV} bytes)")
    # SIGINT ignored from the start (python then installs no handler of its own) until the kernel's is in
    return f"trap '' INT; exec python3 -u -c '{_LOADER}'", {ENV_NAME: source_}


def request(id: str, code: str, env_vars: dict[str, str] | None = None, language: str = "python") -> bytes:
    """The stdin line that runs ``code`` (``env_vars`` set for this request only) as ``language`` (``LANGUAGES``)."""
    return _dumps({"id": id, "code": code, "env_vars": env_vars, "language": language}).encode() + b"\n"


def split_events(buf: bytes) -> tuple[list[dict[str, Any]], int]:
    """The events of the complete lines at the start of ``buf``, and how many bytes they took. A line that is
    not a JSON object is skipped; a partial last line is left for the next call."""
    events: list[dict[str, Any]] = []
    pos = 0
    while (nl := buf.find(b"\n", pos)) >= 0:
        line, pos = buf[pos:nl], nl + 1
        try:
            event = _loads(line)
        except Exception:  # ValueError, RecursionError: whatever the sandbox wrote
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, pos


# ---- sandbox side ----

def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()  # noqa: UP017 (the sandbox's python may be < 3.11)


def _writer(fd: int) -> Any:
    return open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115


def _silenced(code: str, node: ast.stmt) -> bool:
    """Whether the last expression ends in ``;`` (IPython then shows no result)."""
    lines = code.splitlines()
    end_line, end_col = node.end_lineno or 0, node.end_col_offset or 0
    rest = "\n".join([lines[end_line - 1].encode()[end_col:].decode("utf-8", "replace")] + lines[end_line:])
    return rest.lstrip().startswith(";")


class Kernel:
    def __init__(self) -> None:
        self.main, self.pid = threading.get_ident(), os.getpid()
        self.lock = threading.RLock()  # one writer of the protocol channel at a time
        os.register_at_fork(after_in_child=self.forked)
        self.proto, self.inp = os.dup(1), os.dup(0)  # private (close-on-exec) copies of the channel
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.close(null)
        self.pipes: dict[str, tuple[int, int, int, Any]] = {}  # stream: read end, write end, fd, decoder
        for name, fd in (("stdout", 1), ("stderr", 2)):
            r, w = os.pipe()
            os.set_blocking(r, False)
            try:
                import fcntl
                fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: fewer stalls of a chatty cell
            except (ImportError, OSError):
                pass
            self.pipes[name] = (r, w, fd, codecs.getincrementaldecoder("utf-8")("replace"))
        self.out: Any = None
        self.err: Any = None
        self.id, self.count = "", 0
        self.running, self.critical, self.pending = False, 0, False
        self.loop: Any = None
        module = types.ModuleType("__main__")  # the user's globals, a fresh module as a script's are
        module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = module
        self.ns = module.__dict__
        self.magics, self.shell, self.node = Magics(self.ns), Shell(), Node()
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (lives as long as the kernel)
        sys.meta_path.append(InlineBackend(self.figures))  # no GUI: figures are shown as png results
        os.environ.setdefault("MPLBACKEND", f"module://{INLINE_BACKEND}")
        self.rebind()
        threading.Thread(target=self.drain, name="kernel-drain", daemon=True).start()

    def forked(self) -> None:
        self.lock, self.critical, self.main = threading.RLock(), 0, threading.get_ident()

    def rebind(self) -> None:
        """Undo what the last request did to fds 1 and 2, sys.stdout/err, SIGINT and ``display``."""
        for _r, w, fd, _d in self.pipes.values():
            os.dup2(w, fd)
        if sys.stdout is not self.out or self.out.closed:
            sys.stdout = self.out = _writer(1)
        if sys.stderr is not self.err or self.err.closed:
            sys.stderr = self.err = _writer(2)
        signal.signal(signal.SIGINT, self.on_sigint)
        builtins.display = self.display  # type: ignore[attr-defined]
        setattr(builtins, MAGIC, self.magics)

    def on_sigint(self, signum: int, frame: Any) -> None:
        if not self.running:
            return  # between requests: nothing to interrupt
        if self.critical:
            self.pending = True  # in the middle of a protocol line: raised once it is written
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Hold the channel; a SIGINT meanwhile is raised after, never in the middle of a line."""
        main = threading.get_ident() == self.main
        if main:
            self.critical += 1
        try:
            with self.lock:
                yield
        finally:
            if main:
                self.critical -= 1
                if not self.critical and self.pending:
                    self.pending = False
                    if self.running:
                        raise KeyboardInterrupt

    def emit(self, event: dict[str, Any]) -> None:
        if os.getpid() != self.pid:
            return  # a fork of the kernel (user code's, not exec'd): the channel is the kernel's alone
        line = _dumps({"id": self.id, **event}).encode() + b"\n"
        with self.guard():
            try:
                view = memoryview(line)
                while view:
                    view = view[_write(self.proto, view):]
            except OSError:
                os._exit(0)  # the host closed the channel: nobody is left to serve

    def pump(self, name: str, reads: int) -> None:
        """Turn what waits in the pipe of ``name`` into events (at most ``reads`` reads)."""
        if os.getpid() != self.pid:
            return  # a fork of the kernel: what it read could not be emitted, and would be lost to the kernel
        r, _w, _fd, decoder = self.pipes[name]
        with self.guard():  # what is read is emitted, interrupt or not
            for _ in range(reads):
                try:
                    data = os.read(r, PIPE_READ)
                except OSError:  # drained (EAGAIN), or closed by user code
                    return
                if not data:
                    return
                text = decoder.decode(data)
                if text:
                    self.emit({"type": name, "text": text, "timestamp": _now()})

    def drain(self) -> None:
        streams = {p[0]: name for name, p in self.pipes.items()}
        while True:
            try:
                ready, _, _ = select.select(list(streams), [], [], 1.0)
            except (OSError, ValueError):  # a read end closed under us: sync still drains what it can
                threading.Event().wait(0.1)
                continue
            for r in ready:
                self.pump(streams[r], 1)

    def sync(self) -> None:
        """Emit all the output written so far (the request's own, before its result or end)."""
        for stream in {id(s): s for s in (sys.stdout, sys.stderr, self.out, self.err)}.values():
            with contextlib.suppress(Exception):
                stream.flush()
        for name in self.pipes:
            self.pump(name, MAX_DRAIN)

    def show(self, obj: Any, main: bool, raw: bool = False) -> None:
        result = formats(obj, raw)
        self.sync()  # what was printed before comes first
        self.emit({"type": "result", **result, "is_main_result": main})

    def display(self, *objs: Any, raw: bool = False, **_: Any) -> None:
        """IPython's ``display``: each object as a result that is not the main one."""
        for obj in objs:
            self.show(obj, False, raw)

    def evaluate(self, code: types.CodeType) -> Any:
        value = eval(code, self.ns)
        if code.co_flags & _CO_COROUTINE:
            if self.loop is None:
                import asyncio
                self.loop = asyncio.new_event_loop()
            value = self.loop.run_until_complete(value)
        return value

    def run_cell(self, code: str) -> None:
        name = f"<cell-{self.count}>"
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        code = transform(code)  # IPython's lines (!cmd, %magic), line for line: the traceback shows the cell's
        tree = compile(code, name, "exec", ast.PyCF_ONLY_AST | flags)
        last = None
        node = tree.body[-1] if tree.body else None
        if isinstance(node, ast.Expr) and not _silenced(code, node):
            last = ast.Expression(node.value)
            tree.body.pop()
        self.evaluate(compile(tree, name, "exec", flags))
        if last is not None:
            value = self.evaluate(compile(last, name, "eval", flags))
            if value is not None:
                self.ns["_"] = value
                self.show(value, True)
        self.figures()

    def figures(self) -> None:
        """Matplotlib's open figures as png results, then closed (as Jupyter's inline backend does)."""
        for result in figures():
            self.sync()
            self.emit({"type": "result", **result, "is_main_result": False})

    def other(self, language: str, code: str, env: dict[str, str]) -> None:
        """A bash script or a JavaScript cell: its value or its error as events."""
        if language == "bash":
            status = self.shell.run(code, env)
            out = {"name": "CalledProcessError", "value": f"exit status {status}",
                   "traceback": f"bash exited with status {status}\n"} if status else {}
        else:
            out = self.node.run(code, env)
        self.sync()
        if out.pop("restarted", False):
            self.emit({"type": "stderr", "text": "(node was restarted after an interrupt: its state is gone)\n",
                       "timestamp": _now()})
        if "name" in out:
            self.emit({"type": "error", **out})
        elif "text" in out:
            self.emit({"type": "result", "text": out["text"], "extra": {}, "is_main_result": True})

    def report(self, exc: BaseException) -> None:
        """An ``error`` event for ``exc``, its traceback without the kernel's own frames."""
        name = type(exc).__name__
        self.running = True  # a user's __str__ may loop: interruptible
        try:
            value, text = str(exc), error_text(exc)
        except BaseException:
            value, text = "", f"{name}: <exception str() failed>\n"
        self.running = False
        self.sync()
        self.emit({"type": "error", "name": name, "value": value, "traceback": text})

    def execute(self, req: dict[str, Any]) -> None:
        self.count += 1
        env = req.get("env_vars") or {}
        saved = {k: os.environ.get(k) for k in env if isinstance(k, str)}
        try:
            self.rebind()
            self.pending, self.running = False, True
            self.emit({"type": "number_of_executions", "execution_count": self.count})
            for k, v in env.items():
                os.environ[k] = v
            if req.get("language", "python") == "python":
                self.run_cell(req["code"])
            else:
                self.other(req["language"], req["code"], env)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt included: the kernel keeps serving
            self.running = False
            self.report(exc)
        finally:
            self.running = False
            if os.getpid() != self.pid:
                os._exit(0)  # a fork of the kernel in user code, back here: only the kernel serves
            for k, old in saved.items():
                with contextlib.suppress(Exception):
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old

    def handle(self, line: bytes, too_long: bool) -> None:
        match = _ID.match(line)
        try:
            self.id = _loads(match.group(1)) if match else ""
        except ValueError:
            self.id = ""
        try:
            if too_long:
                raise ValueError(f"request line over {MAX_LINE} bytes")
            req = _loads(line)
            if not (isinstance(req, dict) and isinstance(req.get("id"), str) and isinstance(req.get("code"), str)
                    and isinstance(req.get("env_vars") or {}, dict) and req.get("language", "python") in LANGUAGES
                    and all(isinstance(v, str) for v in (req.get("env_vars") or {}).values())):
                raise ValueError("a request is {id: str, code: str, env_vars: {str: str} | null, language: "
                                 "'python' | 'bash' | 'javascript'}")
            self.id = req["id"]
        except Exception as exc:
            self.emit({"type": "error", "name": "InvalidRequest", "value": str(exc), "traceback": ""})
        else:
            with contextlib.suppress(BaseException):  # a second SIGINT while the first is reported
                self.execute(req)
        self.sync()
        self.emit({"type": "end"})

    def lines(self) -> Iterator[tuple[bytes, bool]]:
        """(line, too_long) for each request line on stdin, holding at most MAX_LINE bytes of one."""
        buf, skip = bytearray(), False
        while chunk := os.read(self.inp, READ_CHUNK):
            pos = 0
            while pos < len(chunk):
                nl = chunk.find(b"\n", pos)
                end = len(chunk) if nl < 0 else nl
                if not skip:
                    buf += chunk[pos:end]
                if len(buf) > MAX_LINE:
                    yield bytes(buf[:1024]), True
                    buf.clear()
                    skip = True
                if nl >= 0:
                    if not skip:
                        yield bytes(buf), False
                    buf.clear()
                    skip = False
                pos = end + 1


def main() -> None:
    kernel = Kernel()
    for line, too_long in kernel.lines():
        with contextlib.suppress(BaseException):  # never dies of a request
            kernel.handle(line, too_long)
    kernel.sync()
    os._exit(0)  # stdin closed: the host is done (user threads do not keep the kernel alive)


if __name__ == "__main__":
    main()
