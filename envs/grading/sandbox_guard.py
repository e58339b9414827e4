"""The program the grader runs the tests with, inside the grading sandbox (written there from the host).

It is not imported by agentenv: ``envs.grading.audit`` writes this file's text into the grading folder
(``/var/lib/agentenv-grade-<random>``, mode 700, outside /testbed) and runs it with the image's interpreter
as ``python guard.py CONFIG pytest ARGS...`` (in place of ``python -m pytest ARGS...``) and as ``python
guard.py CONFIG solo``. Standard library only, Python 3.8+.

Before any code of the repository runs it installs a PEP 578 audit hook, which nothing in the process can
remove. The hook watches the means by which code could reach the test runner's objects or the grader's
files from inside the process — frames (``sys._getframe``, a traceback's ``tb_frame``, a generator's
``gi_frame``), ``gc`` walks, ``ctypes``, tracing and profiling hooks, the writes to class and function
attributes Python audits (``__code__``, ``__bases__``, ...: an ordinary class attribute write raises no event, which
the watched state of ``solo.py`` and the canaries are for), code compiled from strings, imports of the runner's
modules, new processes, the grading folder (by path, or by its name in a relative one; ``os.chdir`` too) and
``/proc`` — and flags such an event when it comes from the code the patch added (the config
lists, for each file the patch touches, its added lines; a new file is added throughout). A flagged
event is written at once to the audit log (an append-only file opened before any repository code ran,
checked to be the same file at each write) and then refused (the hook raises), so the attempt both
fails and is reported. What comes "from" the patch: for a frame-returning event, the frame that asked
(past the ``inspect``, ``traceback`` and ``logging`` functions that hand frames to their caller:
``inspect.stack``, ``traceback.walk_tb``, ...); for the others, any frame on the stack
that runs added code (a function containing an added line, or a module body at an added line).

Two things hold before the hook, by construction:
- **No signal handler set from Python ever runs.** The guard first starts itself again under a seccomp
  filter that turns each ``rt_sigaction`` with a new action into a no-op (``_seal_and_restart``): a
  handler is handed the interrupted frame, which no audit event reports.
- **The hook and the isolated run use builtins of their own.** Both files run in a private namespace
  (``main``), so a patch that rebinds ``builtins.getattr`` or ``json.dumps`` changes nothing they call.

``solo`` mode is the isolated run (``sandbox_solo.py``): FAIL_TO_PASS tests and canaries called without
pytest's runner, so that rewriting pytest's reports changes nothing there. ``unittest`` and ``sympy`` modes run
another runner's program with a recorder of its outcomes (``sandbox_runners.py``): ``python guard.py CONFIG
unittest tests/runtests.py ARGS...`` for Django's, ``... sympy bin/test ARGS...`` for SymPy's.
"""

import contextlib
import sys

SOLO_FILE = "solo.py"   # the isolated run (``sandbox_solo.py``), written beside this file
RUNNERS_FILE = "runners.py"   # the modes of other runners (``sandbox_runners.py``), written beside this file


def _load(path):
    import json

    with open(path) as f:
        return json.load(f)


def _install(cfg):
    """Install the audit hook (see the module doc); return a function that writes a line to the audit log."""
    import json
    import os
    import threading
    from bisect import bisect_left

    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    log = os.open(cfg["log"], flags, 0o600)
    st = os.fstat(log)
    ident = (st.st_dev, st.st_ino)
    fstat, write, exit_, isfile = os.fstat, os.write, os._exit, os.path.isfile
    quote = json.encoder.encode_basestring_ascii  # the C function: json.dumps goes through a patchable global
    getframe = sys._getframe
    patched = {p: (None if v is None else sorted(v)) for p, v in cfg["patched"].items()}
    modules = frozenset(cfg["modules"])
    paths = tuple(cfg["paths"])
    runner_modules = frozenset(("_pytest", "pytest", "pluggy", "py", "ctypes", "_ctypes", "_testcapi",
                                "_testinternalcapi", "_xxsubinterpreters"))
    runner_prefixes = tuple(cfg.get("runner_modules", ()))   # another runner's modules (``django.test``, ...)
    marker = paths[-1].rsplit("/", 1)[-1] if paths else ""  # the grading folders' name: in a relative path too
    frame_attrs = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"))
    any_events = frozenset(("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                            "sys.settrace", "sys.setprofile", "sys.addaudithook", "subprocess.Popen", "os.system",
                            "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
                            "os.killpg", "os.truncate", "code.__new__", "_thread.start_new_thread"))
    path_events = frozenset(("open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.rmdir",
                             "os.chmod", "os.link", "os.symlink", "shutil.rmtree", "os.chdir"))
    state = threading.local()
    code_type, str_, bytes_, qualname = type(_load.__code__), str, bytes, type.__dict__["__qualname__"].__get__
    fspath = os.fspath
    import pathlib

    path_types = frozenset(c for c in vars(pathlib).values() if isinstance(c, type) and issubclass(c, pathlib.PurePath))

    def brief(args):  # what the log shows of an event's arguments, without running any of their code
        return ", ".join(str_.__str__(a)[:80] if issubclass(type(a), str_) else qualname(type(a)) for a in args)

    def as_path(target):  # a path argument as text, without running code of the patch's own (None: not one)
        t = type(target)
        if issubclass(t, str_):
            return str_.__str__(target)
        if issubclass(t, bytes_):
            return bytes_.decode(bytes_(target), "utf-8", "replace")
        if t in path_types:  # pathlib's own classes: their fspath is pathlib's
            return str_.__str__(fspath(target))
        return None if t is int else ""   # "": an object of another kind, refused from the patch's code

    ranges: dict = {}
    seen: list = []

    def added(code, line):
        if code.co_filename not in patched:
            return False
        lines = patched[code.co_filename]
        if lines is None:
            return True
        if code.co_name == "<module>":
            i = bisect_left(lines, line)
            return i < len(lines) and lines[i] == line
        span = ranges.get(code)
        if span is None:
            nums = [n for _, _, n in code.co_lines() if n is not None]
            span = ranges[code] = (min(nums), max(nums)) if nums else (code.co_firstlineno,) * 2
        i = bisect_left(lines, span[0])
        return i < len(lines) and lines[i] <= span[1]

    def where(f):
        return f"{f.f_code.co_filename}:{f.f_lineno}"

    def on_stack(f):
        while f is not None:
            if added(f.f_code, f.f_lineno):
                return f
            f = f.f_back
        return None

    def asker(f, passing):
        while f is not None and passing(f.f_code):
            f = f.f_back
        return f if f is not None and added(f.f_code, f.f_lineno) else None

    givers = frozenset(("currentframe", "stack", "trace", "getouterframes", "getinnerframes", "walk_stack",
                        "walk_tb", "<lambda>"))

    def frame_helper(code):  # the standard library's functions that hand frames to their caller
        name = code.co_filename.rsplit("/", 1)[-1]
        return code.co_name in givers and (name in ("inspect.py", "traceback.py") or (
            name == "__init__.py" and "/logging/" in code.co_filename))

    def import_machinery(code):
        fn = code.co_filename
        return fn.startswith("<frozen importlib") or "/importlib/" in fn or fn.endswith(
            ("/runpy.py", "/codeop.py", "/code.py", "/timeit.py", "/doctest.py", "/pdb.py", "/bdb.py"))

    def same_source(source, filename):
        if not isinstance(filename, str) or not isfile(filename):
            return False
        try:
            with open(filename, "rb") as fh:
                data = fh.read()
        except OSError:
            return False
        if isinstance(source, str):
            source = source.encode("utf-8", "surrogateescape")
        return isinstance(source, (bytes, bytearray)) and bytes(source) == data

    def note(event, detail, at):
        """Write a line to the audit log (at most 50); stop the process if the log is not the one opened."""
        line = f'{{"event": {quote(event)}, "detail": {quote(detail[:200])}, "where": {quote(at)}}}\n'
        try:
            st = fstat(log)
            if (st.st_dev, st.st_ino) != ident:
                exit_(97)
            if len(seen) < 50:
                write(log, line.encode("utf-8", "replace"))
            seen.append(event)
        except OSError:
            exit_(97)

    def record(event, detail, f):
        note(event, detail, where(f))
        raise RuntimeError(f"agentenv grader: {event} refused ({detail[:100]}) at {where(f)}")

    def judge(event, args, caller):
        if event in any_events:
            f = on_stack(caller)
            if f is not None:
                record(event, brief(args), f)
        elif event == "sys._getframe":
            f = asker(caller, frame_helper)
            if f is not None:
                record(event, "", f)
        elif event == "object.__getattr__":
            if len(args) > 1 and type(args[1]) is str_ and args[1] in frame_attrs:
                f = asker(caller, frame_helper)
                if f is not None:
                    record(event, args[1], f)
        elif event in ("object.__setattr__", "object.__delattr__"):
            obj, name = args[0], args[1] if len(args) > 1 else ""
            if issubclass(type(obj), type):  # a class of a module the patch touches may change its own
                owner = type.__dict__["__dict__"].__get__(obj).get("__module__")
                if type(owner) is str_ and owner in modules and not (type(name) is str_ and name == "__module__"):
                    return
            f = asker(caller, lambda code: False)
            if f is not None:
                what = qualname(obj) if issubclass(type(obj), type) else qualname(type(obj))
                record(event, f"{what}.{brief((name,))}", f)
        elif event == "import":
            name = args[0] if args and type(args[0]) is str_ else ""
            if name.split(".", 1)[0] in runner_modules or any(
                    name == m or name.startswith(m + ".") for m in runner_prefixes):
                f = on_stack(caller)
                if f is not None:
                    record(event, name, f)
        elif event == "compile":
            source, filename = (args + (None, None))[:2]
            f = asker(caller, import_machinery)
            if f is not None and not (f is not caller and same_source(source, filename)):
                record(event, brief((filename,)), f)
        elif event in ("marshal.loads", "marshal.load"):  # from the import system: a module's cached bytecode
            f = asker(caller, import_machinery)
            if f is not None and f is caller:
                record(event, "", f)
        elif event == "exec":
            code = args[0] if args else None
            f = asker(caller, import_machinery)
            filename = code.co_filename if type(code) is code_type else ""
            if f is not None and not (f is not caller and type(filename) is str_ and isfile(filename)):
                record(event, brief((filename,)), f)
        elif event in path_events or event.startswith("ctypes."):
            target = as_path(args[0]) if args else None
            if event.startswith("ctypes.") or target == "" or (target is not None and (
                    target.startswith(paths) or (marker and marker in target) or (
                        event == "open" and target.endswith(".pyc") and len(args) > 1 and type(args[1]) is str_
                        and "r" not in args[1]))):
                f = on_stack(caller)
                if f is not None:
                    record(event, target or brief(args[:1]), f)

    def hook(event, args):
        if getattr(state, "busy", False):
            return
        state.busy = True
        try:
            try:
                caller = getframe(1)
            except ValueError:  # no Python frame raised it (the interpreter's own, at exit): not the patch's code
                return
            judge(event, args, caller)
        finally:
            state.busy = False

    sys.addaudithook(hook)
    write(log, b'{"event": "started"}\n')
    return note


def _pytest(args):
    import os
    import runpy

    sys.argv = [sys.argv[0], *args]
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first
    runpy.run_module("pytest", run_name="__main__", alter_sys=True)


def _seal_and_restart():
    """Start this program again (``sealed`` first in its arguments) under a seccomp filter that makes every
    ``rt_sigaction`` installing an action succeed without effect, for this process and all it starts.

    A signal handler is handed the interrupted frame, and no audit event says so; from there ``f_back``
    reaches the runner's frames, and ``signal`` can be had afresh without an import (``_imp.create_builtin``).
    With the filter, no handler that Python code sets is ever called: the kernel keeps each signal's default
    action (the restart resets the ones Python had caught). Queries (no new action) go through. Tests that
    need to catch a signal cannot pass under the grader; none of the shipped tasks has one."""
    import ctypes
    import os
    import platform
    import struct

    arch, nr = {"x86_64": (0xC000003E, 13), "aarch64": (0xC00000B7, 134)}.get(platform.machine(), (0, 0))
    if not arch:
        sys.exit(f"agentenv grader: cannot seal signal handlers on {platform.machine()}")

    def ins(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k)

    ld, jeq, ret = 0x20, 0x15, 0x06   # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    noop, eperm, allow = 0x00050000, 0x00050001, 0x7FFF0000   # SECCOMP_RET_ERRNO | 0, | EPERM, RET_ALLOW
    prog = b"".join([
        ins(ld, 0, 0, 4), ins(jeq, 0, 7, arch),      # another ABI: refused
        ins(ld, 0, 0, 0), ins(jeq, 0, 6, nr),        # not rt_sigaction: allowed
        ins(ld, 0, 0, 24), ins(jeq, 0, 2, 0),        # the new action's pointer (args[1]), low half
        ins(ld, 0, 0, 28), ins(jeq, 2, 0, 0),        # high half: both zero is a query, allowed
        ins(ret, 0, 0, noop), ins(ret, 0, 0, eperm), ins(ret, 0, 0, allow)])

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
        sys.exit(f"agentenv grader: cannot seal signal handlers: {os.strerror(ctypes.get_errno())}")
    exe = sys.executable or "/proc/self/exe"
    with open("/proc/self/cmdline", "rb") as f:  # the interpreter's own options (-I, -X ..., -W ...), as given
        cmdline = [os.fsdecode(a) for a in f.read().split(b"\0")[:-1]]
    flags = cmdline[1:len(cmdline) - len(sys.argv)]
    os.execv(exe, [exe, *flags, sys.argv[0], sys.argv[1], "sealed", *sys.argv[2:]])


def _check_sealed():
    """Stop unless a handler set now is never called (the filter of ``_seal_and_restart`` is in place)."""
    import signal

    def set_handler(handler):
        # sealed, the kernel skips the call and leaves the old action Python reads back unwritten: stack bytes
        # that CPython may take for SIG_ERR (an OSError with errno 0), which only says the seal holds
        try:
            signal.signal(urg, handler)
        except OSError as e:
            if e.errno:
                raise

    called = []
    urg = signal.SIGURG  # ignored by default: harmless whether or not the filter holds
    set_handler(lambda *_: called.append(1))
    signal.raise_signal(urg)
    for _ in range(3):  # a handler set by Python runs at the next bytecode boundaries
        pass
    set_handler(signal.SIG_DFL)
    if called:
        sys.exit("agentenv grader: signal handlers are not sealed")


def _handlers_from(patched, signals: tuple):
    """Signals whose Python handler is a function of the patched files (a trace of an attempt; ``signals``:
    the ``signal`` module's functions, bound before the repository's code ran)."""
    valid, getsignal = signals
    out = []
    for s in valid():
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            h = getsignal(s)
            code = getattr(h, "__code__", None)
            if code is not None and code.co_filename in patched:
                out.append((int(s), f"{code.co_filename}:{code.co_firstlineno}"))
    return out


def _run(cfg, mode, rest):
    if mode == "solo":
        solo(cfg, _install)  # type: ignore[name-defined]  # noqa: F821 (the isolated run's, loaded beside)
        return
    if mode in ("unittest", "sympy"):
        run_runner(cfg, mode, rest, _install)  # type: ignore[name-defined]  # noqa: F821 (runners.py's)
        return
    import signal

    signals = (signal.valid_signals, signal.getsignal)
    note = _install(cfg)
    try:
        _pytest(rest)
    finally:
        for signum, where in _handlers_from(cfg["patched"], signals):
            note("signal.signal", f"a handler for signal {signum}", where)


def main():
    """Seal signals (restarting), then run this file and the isolated run's in a namespace of their own, with
    builtins of their own: a patch can rebind ``builtins.getattr`` for everyone else, not for the hook."""
    if sys.argv[2] != "sealed":
        if sys.argv[2:3] == ["sympy"] and not __import__("os").environ.get("PYTHONHASHSEED"):
            # SymPy's runner starts a second, unguarded interpreter unless the seed is set: set it before the
            # restart, so this process hashes with it too
            __import__("os").environ["PYTHONHASHSEED"] = str(__import__("random").SystemRandom().randrange(2**32))
        _seal_and_restart()
    _check_sealed()
    import builtins
    import os

    folder = os.path.dirname(os.path.abspath(sys.argv[0]))
    space: dict = {"__builtins__": dict(vars(builtins)), "__name__": "agentenv_grader"}
    for name in (os.path.basename(sys.argv[0]), SOLO_FILE, RUNNERS_FILE):
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), space)
    space["_run"](_load(sys.argv[1]), sys.argv[3], sys.argv[4:])


if __name__ == "__main__":
    main()
