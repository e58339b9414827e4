"""The run_code kernel, started as a sandbox starts it (``/bin/sh -c``, source in the environment), no container."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from agentenv.inside import kernel


class Kernel:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        cmd, extra = kernel.launch()
        self.proc = subprocess.Popen(["/bin/sh", "-c", cmd], env={**os.environ, **extra, **(env or {})},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.buf = b""
        self.n = 0
        self.lines: list[bytes] = []  # every raw event line, for the SDK's parser

    def send(self, code: str, env_vars: dict[str, str] | None = None) -> str:
        self.n += 1
        rid = f"r{self.n}"
        assert self.proc.stdin is not None
        self.proc.stdin.write(kernel.request(rid, code, env_vars))
        self.proc.stdin.flush()
        return rid

    def read(self, timeout: float = 10) -> list[dict]:
        """The events that arrive next (at least one), within ``timeout``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            events, used = kernel.split_events(self.buf)
            if events:
                self.lines += self.buf[:used].splitlines()
                self.buf = self.buf[used:]
                return events
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no event from the kernel")
            data = os.read(fd, 1 << 20)
            if not data:
                raise EOFError("the kernel exited")
            self.buf += data

    def until_end(self, rid: str, timeout: float = 10) -> list[dict]:
        """The events of request ``rid`` up to its end (excluded)."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.read(max(0.01, deadline - time.monotonic())):
                assert ev["id"] == rid, ev
                if ev["type"] == "end":
                    return out
                out.append(ev)

    def run(self, code: str, env_vars: dict[str, str] | None = None, timeout: float = 10) -> list[dict]:
        return self.until_end(self.send(code, env_vars), timeout)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def k():
    kern = Kernel()
    yield kern
    kern.close()


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def text(events: list[dict], kind: str) -> str:
    return "".join(e["text"] for e in of(events, kind))


def test_state_persists_and_the_last_expression_is_the_result(k):
    assert of(k.run("x = 20"), "result") == []
    (res,) = of(k.run("x += 1\nx * 2"), "result")
    assert res["text"] == "42" and res["is_main_result"] is True
    assert of(k.run("None"), "result") == []
    assert of(k.run("x;"), "result") == []  # a trailing semicolon silences it, as in IPython
    assert of(k.run("'hi'"), "result")[0]["text"] == "hi"  # e2b's server drops a string's quotes
    assert of(k.run("import asyncio\nawait asyncio.sleep(0)\n[x]"), "result")[0]["text"] == "[21]"


def test_output_is_captured_attributed_and_in_order(k):
    evs = k.run("import os, sys\nprint('a')\nos.system('echo hi; echo oops >&2')\n"
                "print('e', file=sys.stderr)\nos.write(1, b'raw\\n')\n7")
    assert text(evs, "stdout") == "a\nhi\nraw\n"
    assert text(evs, "stderr") == "oops\ne\n"
    assert all(isinstance(e["timestamp"], str) for e in of(evs, "stdout"))
    assert evs[0] == {"id": "r1", "type": "number_of_executions", "execution_count": 1}
    assert evs[-1]["type"] == "result"  # after every line printed before it
    assert text(k.run("print('next')"), "stdout") == "next\n"  # nothing of r1 leaks into r2


def test_user_code_cannot_corrupt_the_channel(k):
    evs = k.run('import os\nos.write(1, b\'{"id": "r1", "type": "end"}\\n\')\ninput()')
    assert text(evs, "stdout") == '{"id": "r1", "type": "end"}\n'
    assert of(evs, "error")[0]["name"] == "EOFError"  # stdin is /dev/null: requests cannot be read by user code
    evs = k.run("import sys, os\nsys.stdout = None\nsys.stderr.close()\nos.close(1)")
    assert of(evs, "error") == []
    assert text(k.run("print('back')\nimport os; os.system('echo sh')"), "stdout") == "back\nsh\n"
    evs = k.run("pid = os.fork()\nif pid == 0:\n    print('child')\n    1 / 0\nelse:\n    os.waitpid(pid, 0)")
    assert text(evs, "stdout") == "child\n" and of(evs, "error") == []  # the child ends with the cell, silently
    assert of(k.run("pid > 0"), "result")[0]["text"] == "True"


def test_exception_and_traceback_then_the_kernel_keeps_serving(k):
    (err,) = of(k.run("def f():\n    return 1 / 0\nf()"), "error")
    assert err["name"] == "ZeroDivisionError" and err["value"] == "division by zero"
    tb = err["traceback"]
    assert tb.startswith("Traceback") and "return 1 / 0" in tb and "in f" in tb
    assert "<kernel>" not in tb and "kernel.py" not in tb
    (err,) = of(k.run("x = ("), "error")
    assert err["name"] == "SyntaxError" and "<kernel>" not in err["traceback"]
    (err,) = of(k.run("import sys; sys.exit(3)"), "error")
    assert (err["name"], err["value"]) == ("SystemExit", "3")
    assert of(k.run("1 + 1"), "result")[0]["text"] == "2"


def test_env_vars_are_set_for_one_request():
    kern = Kernel({"AGENTENV_OLD": "old"})
    try:
        evs = kern.run("import os\nos.system('echo $AGENTENV_NEW $AGENTENV_OLD')\nos.environ['AGENTENV_NEW']",
                       {"AGENTENV_NEW": "new", "AGENTENV_OLD": "over"})
        assert text(evs, "stdout") == "new over\n" and of(evs, "result")[0]["text"] == "new"
        evs = kern.run("(os.environ.get('AGENTENV_NEW'), os.environ['AGENTENV_OLD'], 'AGENTENV_KERNEL' in os.environ)")
        assert of(evs, "result")[0]["text"] == "(None, 'old', False)"
    finally:
        kern.close()


def test_display_and_rich_formats(k):
    evs = k.run("class H:\n    def _repr_html_(self): return '<b>h</b>'\n"
                "    def _repr_markdown_(self): return '**h**'\n    def _repr_png_(self): return b'\\x89PNG'\n"
                "    def _repr_json_(self): return {'a': 1}\n    def __repr__(self): return 'H()'\n"
                "display(H(), 5)\nprint('between')\nH()")
    shown, five, main = of(evs, "result")
    assert shown["is_main_result"] is False and five["text"] == "5" and main["is_main_result"] is True
    assert (main["text"], main["html"], main["markdown"], main["png"], main["json"]) == (
        "H()", "<b>h</b>", "**h**", "iVBORw==", {"a": 1})
    assert [e["type"] for e in evs] == ["number_of_executions", "result", "result", "stdout", "result"]
    bad = k.run("class B:\n    def _repr_html_(self): raise ValueError\nB()")  # a failing formatter is skipped
    assert "html" not in of(bad, "result")[0] and of(bad, "error") == []


def test_matplotlib_figures_are_png_results():
    pytest.importorskip("matplotlib")
    kern = Kernel({"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    try:  # the kernel runs this interpreter, which has matplotlib
        evs = kern.run("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\n5", timeout=15)
        fig, main = of(evs, "result")  # plt.show() emits at once, as Jupyter's inline backend does
        assert main["text"] == "5" and main["is_main_result"] and fig["is_main_result"] is False
        assert fig["text"].startswith("<Figure") and fig["png"].startswith("iVBORw0KGgo")
        assert of(kern.run("plt.get_fignums()"), "result")[0]["text"] == "[]"  # shown once, then closed
        main, fig = of(kern.run("plt.plot([2, 1])\n6", timeout=15), "result")  # left open: after the value
        assert main["text"] == "6" and fig["png"].startswith("iVBORw0KGgo")
    finally:
        kern.close()


def test_large_output_streams_without_deadlock(k):
    evs = k.run("import os\nprint('x' * 3_000_000)\nos.system('head -c 2000000 /dev/zero | tr \"\\\\0\" y')\n1",
                timeout=15)
    out = text(evs, "stdout")
    assert len(out) == 5_000_001 and out.count("x") == 3_000_000 and out.count("y") == 2_000_000
    assert max(len(e["text"]) for e in of(evs, "stdout")) <= kernel.PIPE_READ
    assert of(evs, "result")[0]["text"] == "1"


def test_sigint_interrupts_the_request_and_the_kernel_keeps_serving(k):
    assert of(k.run("1"), "result")  # up: its handler is in
    k.proc.send_signal(signal.SIGINT)  # idle: nothing to interrupt, nothing dies
    rid = k.send("import time\nprint('ready', flush=True)\ntime.sleep(30)")
    evs: list[dict] = []
    while not any(e.get("text") == "ready\n" for e in evs):  # in the cell by now
        evs += k.read()
    assert [e["type"] for e in evs] == ["number_of_executions", "stdout"]
    start = time.monotonic()
    k.proc.send_signal(signal.SIGINT)
    evs = k.until_end(rid, timeout=5)
    assert time.monotonic() - start < 5
    (err,) = of(evs, "error")
    assert err["name"] == "KeyboardInterrupt" and '"<cell-2>"' in err["traceback"]  # in sleep, or print's return
    assert "<kernel>" not in err["traceback"]
    assert of(k.run("2 + 2"), "result")[0]["text"] == "4"


def test_number_of_executions_counts_requests(k):
    counts = [of(k.run(code), "number_of_executions")[0]["execution_count"] for code in ("1", "1/0", "x = (", "2")]
    assert counts == [1, 2, 3, 4]


def test_bad_request_lines_are_answered_and_skipped(k):
    assert k.proc.stdin is not None
    k.proc.stdin.write(b"not json\n")
    k.proc.stdin.flush()
    evs = k.until_end("")
    assert of(evs, "error")[0]["name"] == "InvalidRequest"
    k.proc.stdin.write(b'{"id": "big", "code": "' + b"x" * (kernel.MAX_LINE + 10) + b'"}\n')
    k.proc.stdin.flush()
    assert of(k.until_end("big"), "error")[0]["value"].startswith("request line over")
    assert of(k.run("3"), "result")[0]["text"] == "3"


def test_split_events_keeps_partial_lines_and_skips_garbage():
    buf = b'{"type": "stdout", "text": "a"}\nnot json\n[1, 2]\n\xff\xfe\n' + b"[" * 100_000 + b'\n{"type": "en'
    events, used = kernel.split_events(buf)
    assert events == [{"type": "stdout", "text": "a"}]
    assert buf[used:] == b'{"type": "en'
    assert kernel.split_events(b"") == ([], 0)
    assert kernel.split_events(buf[used:] + b'd"}\n') == ([{"type": "end"}], 16)


def test_request_line_round_trips():
    line = kernel.request("i\n", "print('\\n')\n", {"A": "b"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"id": "i\n", "code": "print('\\n')\n", "env_vars": {"A": "b"}, "language": "python"}
    assert json.loads(kernel.request("j", "ls", None, "bash"))["language"] == "bash"
    cmd, extra = kernel.launch()
    assert "python3" in cmd and " -I" not in cmd and " -S" not in cmd
    assert len(extra[kernel.ENV_NAME].encode()) < 128 << 10
    assert "class Magics" in extra[kernel.ENV_NAME] and "\nfrom agentenv" not in extra[kernel.ENV_NAME]  # joined


def test_events_parse_with_the_sdks_own_parser(k):
    models = pytest.importorskip("e2b_code_interpreter.models")
    k.run("print('hi')\nimport sys; print('warn', file=sys.stderr)")
    k.run("display(1)\n1 + 2")
    k.run("1 / 0")
    execution = models.Execution()
    for line in k.lines:
        models.parse_output(execution, line.decode())
    assert execution.logs.stdout == ["hi\n"] and execution.logs.stderr == ["warn\n"]
    assert [r.text for r in execution.results] == ["1", "3"]
    assert [r.is_main_result for r in execution.results] == [False, True]
    assert execution.text == "3"
    assert execution.error is not None and execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero" and "1 / 0" in execution.error.traceback
    assert execution.execution_count == 3


def test_shell_lines_stream_capture_and_expand(k):
    evs = k.run("!echo out; echo err >&2\nx = 5\nif x:\n    !echo {x + 1} $x '$$HOME'\n!exit 3\n_exit_code")
    assert text(evs, "stdout") == "out\n6 5 $HOME\n" and text(evs, "stderr") == "err\n"
    assert of(evs, "result")[0]["text"] == "3" and of(evs, "error") == []  # as IPython: a failing !cmd is no error
    evs = k.run("lines = !printf 'a\\nb\\n'; echo gone >&2\n(lines, lines.s, lines.n)")
    assert of(evs, "result")[0]["text"] == "(['a', 'b'], 'a b', 'a\\nb')" and text(evs, "stderr") == "gone\n"
    assert of(k.run("!!echo c"), "result")[0]["text"] == "['c']"


def test_percent_and_bang_inside_strings_brackets_and_comments_are_python(k):
    code = "s = '''\n%pip install x\n!rm -rf /\n'''\nt = (10\n% 4)\n# %cd /\nu = 7 %\\\n 4\n(s, t, u)"
    (res,) = of(k.run(code), "result")
    assert res["text"] == "('\\n%pip install x\\n!rm -rf /\\n', 2, 3)"
    assert of(k.run("x = 1\nx %= 1\nx"), "result")[0]["text"] == "0"


def test_cd_pwd_and_env_magics(k, tmp_path):
    evs = k.run(f"%cd {tmp_path}\nimport os\nos.getcwd()")
    assert text(evs, "stdout") == f"{tmp_path}\n" and of(evs, "result")[0]["text"] == str(tmp_path)
    assert of(k.run("%pwd"), "result")[0]["text"] == str(tmp_path)
    k.run("%cd /")
    assert of(k.run("%cd -\n%pwd"), "result")[0]["text"] == str(tmp_path)  # back where it was
    assert of(k.run("%cd /no/such/folder"), "error")[0]["name"] == "FileNotFoundError"
    evs = k.run("%env AGENTENV_M=v 1\n%env AGENTENV_M")
    assert text(evs, "stdout") == "env: AGENTENV_M=v 1\n" and of(evs, "result")[0]["text"] == "v 1"
    assert text(k.run("!echo $AGENTENV_M"), "stdout") == "v 1\n"  # commands inherit it
    assert "AGENTENV_M" in of(k.run("%env"), "result")[0]["text"]
    (err,) = of(k.run("%env AGENTENV_NOT_SET"), "error")
    assert (err["name"], err["value"]) == ("UsageError", "Environment does not have key: AGENTENV_NOT_SET")


def test_pip_runs_the_kernels_python_and_its_failure_is_an_error(k):
    evs = k.run("%pip --version", timeout=60)
    assert text(evs, "stdout").startswith("pip ") and of(evs, "error") == []
    evs = k.run("%pip install --no-index /no/such/pkg.whl", timeout=60)
    (err,) = of(evs, "error")
    assert err["name"] == "CalledProcessError" and "pip install --no-index" in err["value"]
    assert text(evs, "stderr")  # pip's own message streamed before the error


def test_unknown_magics_are_usage_errors_after_the_lines_before_them(k):
    evs = k.run("print('before')\n%timeit 1")
    (err,) = of(evs, "error")
    assert err["name"] == "UsageError" and "`%timeit` not found" in err["value"]
    assert text(evs, "stdout") == "before\n" and "<cell-" in err["traceback"] and "<kernel>" not in err["traceback"]
    (err,) = of(k.run("%%capture\nprint(1)"), "error")
    assert err["name"] == "UsageError" and "`%%capture` not found" in err["value"]


def test_cell_magics_bash_sh_and_writefile(k, tmp_path):
    evs = k.run("\n%%bash\nread -r line || echo 'stdin is empty'\necho $((6 * 7))\necho err >&2")
    assert text(evs, "stdout") == "stdin is empty\n42\n" and text(evs, "stderr") == "err\n" and of(evs, "error") == []
    (err,) = of(k.run("%%sh\necho partial\nexit 4"), "error")
    assert err["name"] == "CalledProcessError" and "status 4" in err["value"]
    f = tmp_path / "w.txt"
    assert text(k.run(f"%%writefile {f}\nline 1\n"), "stdout") == f"Writing {f}\n"
    assert text(k.run(f"%%writefile -a {f}\nline 2\n"), "stdout") == f"Appending to {f}\n"
    assert f.read_text() == "line 1\nline 2\n"


def bash(k: Kernel, code: str, env_vars: dict[str, str] | None = None) -> list[dict]:
    n = k.n = k.n + 1
    assert k.proc.stdin is not None
    k.proc.stdin.write(kernel.request(f"b{n}", code, env_vars, "bash"))
    k.proc.stdin.flush()
    return k.until_end(f"b{n}")


def test_bash_requests_keep_folder_variables_and_functions(k, tmp_path):
    evs = bash(k, f"cd {tmp_path}; X='a b'; f() {{ echo \"fn $X\"; }}; export E=2; echo $R", {"R": "once"})
    assert text(evs, "stdout") == "once\n" and of(evs, "error") == []
    evs = bash(k, "pwd; f; echo $E ${R-unset}; bash -c 'echo $E'")  # R was for that request only
    assert text(evs, "stdout") == f"{tmp_path}\nfn a b\n2 unset\n2\n"
    evs = bash(k, "echo partial; ls /no/such/path; exit 2")
    (err,) = of(evs, "error")
    assert (err["name"], err["value"]) == ("CalledProcessError", "exit status 2") and text(evs, "stdout") == "partial\n"
    assert text(evs, "stderr").startswith("ls: ")
    assert text(bash(k, "echo $X"), "stdout") == "a b\n"  # an exit keeps the state too
    assert of(k.run("import os\nos.getcwd() != ''"), "result")[0]["text"] == "True"  # python requests still run


def test_javascript_requests_keep_their_globals_where_node_exists(k):
    if shutil.which("node") is None:
        pytest.skip("no node on this machine")

    def js(code: str, env_vars: dict[str, str] | None = None) -> list[dict]:
        n = k.n = k.n + 1
        assert k.proc.stdin is not None
        k.proc.stdin.write(kernel.request(f"j{n}", code, env_vars, "javascript"))
        k.proc.stdin.flush()
        return k.until_end(f"j{n}", timeout=20)

    evs = js("var x = 20; let y = 1; function f(a) { return a * 2; }\nconsole.log('hi'); console.error('e')")
    assert text(evs, "stdout") == "hi\n" and text(evs, "stderr") == "e\n" and of(evs, "result") == []
    (res,) = of(js("f(x) + y"), "result")
    assert res["text"] == "41" and res["is_main_result"] is True
    assert of(js("'s'"), "result")[0]["text"] == "s" and of(js("({a: [1]})"), "result")[0]["text"] == "{ a: [ 1 ] }"
    assert of(js("Promise.resolve(5)"), "result")[0]["text"] == "5"  # awaited
    assert of(js("process.env.AGENTENV_J", {"AGENTENV_J": "once"}), "result")[0]["text"] == "once"
    assert of(js("typeof process.env.AGENTENV_J"), "result")[0]["text"] == "undefined"  # for that request only
    (err,) = of(js("nope()"), "error")
    assert err["name"] == "ReferenceError" and "nope is not defined" in err["value"] and "<cell>" in err["traceback"]
    assert of(js("require('path').basename('/a/b')"), "result")[0]["text"] == "b"
    assert of(k.run("1 + 1"), "result")[0]["text"] == "2"  # Python requests still run in the same kernel


def test_transform_finds_logical_line_starts_only():
    from agentenv.inside import magics

    code = 's = """\n%x """\n%env A\nt = [1,\n!no]\nu = 1 + \\\n%2\nif u:\n    v = !ls\n'
    out = magics.transform(code).splitlines()
    assert out[1] == '%x """' and out[4] == "!no]" and out[6] == "%2"  # in a string, a bracket, a continuation
    assert out[2] == f"{magics.MAGIC}('%', 'env A')" and out[8] == f"    v = {magics.MAGIC}('!!', 'ls')"
    assert len(out) == len(code.splitlines())  # line for line: tracebacks keep their numbers
    plain = "x = 1 % 2\ny = not x != 3\n"
    assert magics.transform(plain) is plain
    big = "d = {\n" + "    'k': 1,\n" * 5000 + "}\n!echo\n"  # one tokenize pass, not one per line
    assert magics.transform(big).endswith(f"{magics.MAGIC}('!', 'echo')\n")


def test_the_joined_parts_define_no_name_twice():
    """kernel.source() runs its parts (magics, nodejs, results, kernel) as one module: a name defined in two would be
    overwritten."""
    import ast
    from pathlib import Path

    seen: dict[str, str] = {}
    for name in kernel.PARTS:
        tree = ast.parse((Path(kernel.__file__).parent / f"{name}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                continue
            for n in names:
                assert n not in seen or n == "__all__", f"{n} is defined in {seen.get(n)} and {name}"
                seen[n] = name
