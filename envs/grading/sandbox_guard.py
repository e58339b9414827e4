"""The program the grader runs the tests with, inside the grading sandbox (written there from the host).

It is not imported by agentenv: ``envs.grading.audit`` writes this file's text into the grading folder
(``/var/lib/agentenv-grade-<random>``, mode 700, outside /testbed) and runs it with the image's interpreter
as ``python guard.py CONFIG pytest ARGS...`` (in place of ``python -m pytest ARGS...``) and as ``python
guard.py CONFIG solo``. Standard library only, Python 3.8+.

Before any code of the repository runs it installs a PEP 578 audit hook, which nothing in the process can
remove. The hook watches the means by which code could reach the test runner's objects or the grader's
files from inside the process — frames (``sys._getframe``, a traceback's ``tb_frame``, a generator's
``gi_frame``), ``gc`` walks, ``ctypes``, tracing and profiling hooks, writes to class attributes and
function code, code compiled from strings, imports of the runner's modules, new processes, the grading
folder and ``/proc`` — and flags such an event when it comes from the code the patch added (the config
lists, for each file the patch touches, its added lines; a new file is added throughout). A flagged
event is written at once to the audit log (an append-only file opened before any repository code ran,
checked to be the same file at each write) and then refused (the hook raises), so the attempt both
fails and is reported. What comes "from" the patch: for a frame-returning event, the frame that asked
(past the ``inspect``, ``traceback`` and ``logging`` functions that hand frames to their caller:
``inspect.stack``, ``traceback.walk_tb``, ...); for the others, any frame on the stack
that runs added code (a function containing an added line, or a module body at an added line).

``solo`` mode calls FAIL_TO_PASS tests and canaries directly, without pytest's runner: the test module
is imported as pytest would import it and each test function that can be called plainly (no decorators,
no arguments, no fixtures, no skip/xfail in its text; chosen from the test file's *source* before any
import, so nothing at run time can make a test look ineligible) is called; it passed when it returned.
Its results go to a file opened before the repository's code ran, with a secret read (and deleted) from
the grading folder before that: a result without the secret is not the runner's. Nothing of pytest's
reports is involved, so rewriting them changes nothing here.
"""

import contextlib
import sys
from typing import Any


def _load(path):
    import json

    with open(path) as f:
        return json.load(f)


def _install(cfg):
    """Install the audit hook (see the module doc); return a function that writes a line to the audit log."""
    import _thread
    import json
    import os
    from bisect import bisect_left

    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    log = os.open(cfg["log"], flags, 0o600)
    st = os.fstat(log)
    ident = (st.st_dev, st.st_ino)
    fstat, write, exit_, isfile, dumps = os.fstat, os.write, os._exit, os.path.isfile, json.dumps
    getframe = sys._getframe
    patched = {p: (None if v is None else sorted(v)) for p, v in cfg["patched"].items()}
    modules = frozenset(cfg["modules"])
    paths = tuple(cfg["paths"])
    runner_modules = frozenset(("_pytest", "pytest", "pluggy", "py", "ctypes", "_ctypes", "_testcapi",
                                "_testinternalcapi", "_xxsubinterpreters"))
    frame_attrs = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"))
    any_events = frozenset(("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                            "sys.settrace", "sys.setprofile", "sys.addaudithook", "subprocess.Popen", "os.system",
                            "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
                            "os.killpg", "os.truncate", "code.__new__"))
    path_events = frozenset(("open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.rmdir",
                             "os.chmod", "os.link", "os.symlink", "shutil.rmtree"))
    state = _thread._local()
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

    def record(event, detail, f):
        line = dumps({"event": event, "detail": detail[:200], "where": where(f)}) + "\n"
        try:
            st = fstat(log)
            if (st.st_dev, st.st_ino) != ident:
                exit_(97)
            if len(seen) < 50:
                write(log, line.encode("utf-8", "replace"))
            seen.append(event)
        except OSError:
            exit_(97)
        raise RuntimeError(f"agentenv grader: {event} refused ({detail[:100]}) at {where(f)}")

    def judge(event, args, caller):
        if event in any_events:
            f = on_stack(caller)
            if f is not None:
                record(event, repr(args)[:200], f)
        elif event == "sys._getframe":
            f = asker(caller, frame_helper)
            if f is not None:
                record(event, "", f)
        elif event == "object.__getattr__":
            if len(args) > 1 and args[1] in frame_attrs:
                f = asker(caller, frame_helper)
                if f is not None:
                    record(event, args[1], f)
        elif event in ("object.__setattr__", "object.__delattr__"):
            obj, name = args[0], args[1] if len(args) > 1 else ""
            if isinstance(obj, type) and obj.__dict__.get("__module__") in modules and name != "__module__":
                return
            f = asker(caller, lambda code: False)
            if f is not None:
                record(event, f"{getattr(obj, '__qualname__', type(obj).__name__)}.{name}", f)
        elif event == "import":
            name = args[0] if args and isinstance(args[0], str) else ""
            if name.split(".", 1)[0] in runner_modules:
                f = on_stack(caller)
                if f is not None:
                    record(event, name, f)
        elif event == "compile":
            source, filename = (args + (None, None))[:2]
            f = asker(caller, import_machinery)
            if f is not None and not (f is not caller and same_source(source, filename)):
                record(event, str(filename), f)
        elif event in ("marshal.loads", "marshal.load"):  # from the import system: a module's cached bytecode
            f = asker(caller, import_machinery)
            if f is not None and f is caller:
                record(event, "", f)
        elif event == "exec":
            code = args[0] if args else None
            f = asker(caller, import_machinery)
            filename = getattr(code, "co_filename", "")
            if f is not None and not (f is not caller and isinstance(filename, str) and isfile(filename)):
                record(event, str(filename), f)
        elif event in path_events or event.startswith("ctypes."):
            target = args[0] if args else ""
            if isinstance(target, bytes):
                target = target.decode("utf-8", "replace")
            if event.startswith("ctypes.") or (isinstance(target, str) and (
                    target.startswith(paths) or (event == "open" and target.endswith(".pyc") and len(args) > 1
                                                 and isinstance(args[1], str) and "r" not in args[1]))):
                f = on_stack(caller)
                if f is not None:
                    record(event, str(target), f)

    def hook(event, args):
        if getattr(state, "busy", False):
            return
        state.busy = True
        try:
            caller = getframe(1)
            judge(event, args, caller)
        finally:
            state.busy = False

    sys.addaudithook(hook)
    write(log, b'{"event": "started"}\n')
    return seen


def _eligible(test_file, root):
    """Plain test functions of ``test_file`` (node id -> (class or "", name, def line)), read from its source."""
    import ast

    with open(root + "/" + test_file, "rb") as f:
        source = f.read()
    tree = ast.parse(source)
    text = source.decode("utf-8", "replace").splitlines()
    out: dict = {}
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
           for n in tree.body):
        return out

    def plain(fn, self_arg):
        a = fn.args
        n_args = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
        body = "\n".join(text[fn.lineno - 1:fn.end_lineno])
        return (isinstance(fn, ast.FunctionDef) and not fn.decorator_list and n_args == int(self_arg)
                and not any(w in body for w in ("skip", "xfail", "fixture", "request", "monkeypatch")))

    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and plain(node, False):
            out[f"{test_file}::{node.name}"] = ("", node.name, node.lineno, "function", ())
        elif isinstance(node, ast.ClassDef) and not node.decorator_list and not node.keywords:
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if not node.bases:  # a pytest-style class: only without setup methods
                if not node.name.startswith("Test") or any(m.name.startswith(("setup", "teardown", "__init__"))
                                                           for m in methods):
                    continue
                kind = "class"
            else:  # with bases: called only if it turns out to be a unittest.TestCase
                kind = "unittest"
            for m in methods:
                if m.name.startswith("test") and plain(m, True):
                    out[f"{test_file}::{node.name}::{m.name}"] = (node.name, m.name, m.lineno, kind, ())
            if kind == "unittest":  # a test it inherits (from a mixin): its function is checked at run time
                out[f"{test_file}::{node.name}::*"] = (node.name, "*", None, kind, tuple(m.name for m in methods))
    return out


def _watched_state():
    """The test machinery a patch could blunt so that a test passes: the function and class attributes of
    ``builtins``, ``unittest`` and pytest's modules, and of their classes (identities, kept alive)."""
    state = {}
    for name, mod in list(sys.modules.items()):
        if name == "builtins" or name.split(".", 1)[0] in ("unittest", "pytest", "_pytest"):
            for k, v in list(vars(mod).items()):
                if callable(v):
                    state[(name, k, "")] = v
                if isinstance(v, type) and v.__module__ == name:
                    for kk, vv in list(vars(v).items()):
                        state[(name, k, kk)] = vv
    return state


def _changed(state):
    out = []
    for (name, k, kk), v in state.items():
        mod = sys.modules.get(name)
        now = vars(mod).get(k) if mod is not None else None
        if kk:
            now = vars(now).get(kk) if isinstance(now, type) else None
        if now is not v:
            out.append(f"{name}.{k}" + (f".{kk}" if kk else ""))
    return out


def _defines(path, line, name):
    """The file at ``path`` has ``def name(`` at ``line`` (a test a class inherits, found at run time)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    return 0 < line <= len(lines) and lines[line - 1].lstrip().startswith((f"def {name}(", f"async def {name}("))


def _module_for(test_file, root):
    """(folder to put first on sys.path, dotted module name), as pytest's default import mode finds them."""
    import os

    parts = test_file[:-3].split("/")
    base = len(parts) - 1
    while base > 0 and os.path.isfile(os.path.join(root, *parts[:base], "__init__.py")):
        base -= 1
    return os.path.join(root, *parts[:base]), ".".join(parts[base:])


def _solo(cfg):
    import os

    key_path = cfg["folder"] + "/solo.key"
    with open(key_path) as f:
        secret = f.read().strip()
    os.unlink(key_path)
    out = os.open(cfg["folder"] + "/solo.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                  0o600)
    root = cfg["root"]
    plans: dict = {}
    uses_pytest = False
    for tid in cfg["solo"]:
        test_file = tid.split("::", 1)[0]
        try:
            plans.setdefault(test_file, _eligible(test_file, root))
            with open(root + "/" + test_file, encoding="utf-8", errors="replace") as f:
                uses_pytest = uses_pytest or "pytest" in f.read()
        except (OSError, SyntaxError, ValueError):
            plans[test_file] = {}
    import importlib
    import json
    import types

    write, exit_, code_type, func_type = os.write, os._exit, types.CodeType, types.FunctionType
    import unittest

    if uses_pytest:  # imported before the repository's code, so that the state watched is pytest's own
        with contextlib.suppress(ImportError):
            import pytest  # noqa: F401
    watched = _watched_state()
    test_case = unittest.TestCase
    patched = cfg["patched"]
    results = {}
    _install(cfg)
    os.chdir(root)
    for tid in cfg["solo"]:
        test_file, _, rest = tid.partition("::")
        plan = plans[test_file].get(tid) or plans[test_file].get(f"{test_file}::{rest.rsplit('::', 1)[0]}::*")
        if plan is None:
            results[tid] = "UNSUPPORTED"
            continue
        cls_name, name, line, kind, own = plan
        name = tid.rsplit("::", 1)[1] if name == "*" else name
        if name in own:  # defined in the class but not plainly (decorated, arguments): not called
            results[tid] = "UNSUPPORTED"
            continue
        folder, dotted = _module_for(test_file, root)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            module = importlib.import_module(dotted)
            cls: Any = module.__dict__[cls_name] if cls_name else None
            if kind == "unittest" and not (isinstance(cls, type) and issubclass(cls, test_case)):
                results[tid] = "UNSUPPORTED"
                continue
            holder = next((k.__dict__ for k in cls.__mro__ if name in k.__dict__), {}) if cls else module.__dict__
            fn = holder[name]
            code = fn.__code__ if type(fn) is func_type else None
        except BaseException as e:  # the module would not import: as pytest reports it, an error
            results[tid] = f"ERROR {type(e).__name__}"
            continue
        where = root + "/" + test_file
        if type(code) is not code_type or (line is not None and (code.co_filename, code.co_firstlineno) != (where, line)):
            results[tid] = "MISMATCH"  # not the function the test file defines
            continue
        if line is None and (code.co_filename in patched or not code.co_filename.startswith(root + "/")):
            results[tid] = "MISMATCH" if code.co_filename in patched else "UNSUPPORTED"
            continue
        if line is None and not _defines(code.co_filename, code.co_firstlineno, name):
            results[tid] = "UNSUPPORTED"  # decorated, or not where it says: not called
            continue
        try:
            if kind == "unittest":
                cls.setUpClass()
                case = cls(name)
                case.setUp()
                try:
                    fn(case)
                finally:
                    case.tearDown()
                    case.doCleanups()
                    cls.tearDownClass()
            elif cls is not None:
                fn(cls())
            else:
                fn()
            results[tid] = "PASSED"
        except unittest.SkipTest:
            results[tid] = "SKIPPED"
        except BaseException as e:  # a skip or xfail raised from outside the test's text counts as a failure
            results[tid] = f"FAILED {type(e).__name__}"
        blunted = _changed(watched)
        if blunted:
            results[tid] = "MISMATCH " + ",".join(blunted[:3])
    write(out, json.dumps({"secret": secret, "results": results}).encode())
    exit_(0)


def _pytest(args):
    import os
    import runpy

    sys.argv = [sys.argv[0], *args]
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first
    runpy.run_module("pytest", run_name="__main__", alter_sys=True)


def main():
    cfg = _load(sys.argv[1])
    mode, rest = sys.argv[2], sys.argv[3:]
    if mode == "solo":
        _solo(cfg)
    else:
        _install(cfg)
        del sys.argv[1:3]
        _pytest(rest)


if __name__ == "__main__":
    main()
