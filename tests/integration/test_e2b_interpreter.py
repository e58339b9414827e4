"""The code interpreter as Jupyter users expect it, through the official ``e2b_code_interpreter`` SDK against a real
``agentenv serve`` and real sandboxes: a chart from the default template's data stack, IPython lines (``!cmd``,
``%pip``, ``%cd``), rich results, bash contexts
(through a fork too), and JavaScript refused where the image has no node."""

from __future__ import annotations

import base64
import io
import zipfile
from collections.abc import Iterator

import httpx
import pytest

code_interpreter = pytest.importorskip("e2b_code_interpreter")

from e2b_code_interpreter import Sandbox  # noqa: E402

from .conftest import e2b_sandbox, envd_token  # noqa: E402


def _wheel(name: str, source: str) -> bytes:
    """A pure-Python wheel of one module, made by hand (no build tools in the sandbox, no index to fetch from)."""
    dist = f"{name}-0.1.dist-info"
    files = {f"{name}.py": source, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: agentenv-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(path, text)
    return buf.getvalue()


@pytest.fixture
def ci(e2b_url: str) -> Iterator[Sandbox]:
    with e2b_sandbox(Sandbox) as sb:
        yield sb


def test_ipython_lines(ci: Sandbox) -> None:
    run = ci.run_code("!echo shell $USER\nn = 3\n!echo {n * 2}")
    assert run.logs.stdout == ["shell user\n", "6\n"] and run.error is None  # as E2B's user, expanded as IPython
    assert ci.run_code("%pip --version").logs.stdout[0].startswith("pip ")
    listed = ci.run_code("%pip list")
    assert listed.error is None and "pip" in "".join(listed.logs.stdout)
    failed = ci.run_code("%pip install --no-index no-such-package-agentenv")
    assert failed.error is not None and failed.error.name == "CalledProcessError" and failed.logs.stderr
    ci.files.write("/tmp/wheels/tiny_agentenv-0.1-py3-none-any.whl", _wheel("tiny_agentenv", "VALUE = 7\n"))
    installed = ci.run_code("%pip install --no-index --no-deps /tmp/wheels/tiny_agentenv-0.1-py3-none-any.whl\n"
                            "import tiny_agentenv\ntiny_agentenv.VALUE")
    assert installed.error is None and installed.text == "7"  # Debian's externally-managed mark does not refuse it
    run = ci.run_code("%cd /tmp\nimport os\nos.getcwd()")
    assert run.text == "/tmp" and run.logs.stdout == ["/tmp\n"]
    assert ci.run_code("os.getcwd()").text == "/tmp"  # the next execution is still there
    err = ci.run_code("%timeit 1").error
    assert err is not None and err.name == "UsageError" and "%timeit" in err.value


def test_the_default_template_charts_with_the_data_stack(ci: Sandbox) -> None:
    """The code interpreter SDK's default template has numpy, pandas and matplotlib (pinned, built into the image
    offline: nothing is installed now): a chart drawn from a DataFrame comes back as a PNG result."""
    run = ci.run_code("import numpy as np, pandas as pd, matplotlib.pyplot as plt\n"
                      "df = pd.DataFrame({'x': np.arange(5), 'y': np.arange(5) ** 2})\n"
                      "df.plot(x='x', y='y')\nplt.title('squares')\nplt.show()\nint(df.y.sum())")
    assert run.error is None, run.error
    chart, total = run.results
    assert base64.b64decode(chart.png).startswith(b"\x89PNG\r\n\x1a\n") and total.text == "30"


def test_rich_results(ci: Sandbox) -> None:
    run = ci.run_code(
        "import base64\nclass R:\n    def _repr_png_(self): return base64.b64decode('iVBORw0KGgo=')\n"
        "    def _repr_html_(self): return '<b>r</b>'\n    def _repr_markdown_(self): return '*r*'\n"
        "    def _repr_json_(self): return {'r': 1}\n"
        "    def _repr_svg_(self): return '<svg xmlns=\"http://www.w3.org/2000/svg\"/>'\n"
        "    def __repr__(self): return 'R()'\nR()")
    (res,) = run.results
    assert (res.text, res.png, res.html, res.markdown, res.json) == ("R()", "iVBORw0KGgo=", "<b>r</b>", "*r*", {"r": 1})
    assert res.svg is not None and res.svg.startswith("<svg") and res.is_main_result
    assert set(res.formats()) >= {"png", "html", "markdown", "json", "svg"}


def test_bash_contexts_keep_their_folder_and_variables_through_a_fork(e2b_url: str, ci: Sandbox) -> None:
    ctx = ci.create_code_context(language="bash", cwd="/tmp")
    assert ctx.language == "bash" and ctx.cwd == "/tmp"
    assert ci.run_code("pwd; mkdir -p d && cd d; X=kept", context=ctx).logs.stdout == ["/tmp\n"]
    run = ci.run_code("pwd; echo $X; whoami", context=ctx)
    assert "".join(run.logs.stdout) == "/tmp/d\nkept\nuser\n" and run.error is None
    failed = ci.run_code("echo before; false", context=ctx)
    assert failed.logs.stdout == ["before\n"] and failed.error is not None and failed.error.value == "exit status 1"
    assert "bash" in [c.language for c in ci.list_code_contexts()]
    assert "".join(ci.run_code("echo $0 | grep -c bash", language="bash").logs.stdout) == "1\n"  # its default one
    (kid,) = ci.fork(count=1)
    try:
        assert "".join(kid.run_code("pwd; echo $X", context=ctx).logs.stdout) == "/tmp/d\nkept\n"
    finally:
        kid.kill()
    # the SDK sends a context or a language; a server asked for both answers 400 where they disagree
    headers = {"E2b-Sandbox-Id": ci.sandbox_id, "X-Access-Token": envd_token(ci) or "",
               "E2b-Sandbox-Port": "49999"}
    r = httpx.post(f"{e2b_url}/execute", headers=headers, json={"code": "1", "context_id": ctx.id, "language": "py"})
    assert r.status_code == 400 and "runs bash" in r.json()["message"]


def test_javascript_is_refused_where_node_is_not_in_the_image(ci: Sandbox) -> None:
    assert ci.commands.run("command -v node || echo none").stdout == "none\n"
    with pytest.raises(Exception, match="needs node, which is not in this sandbox's image") as e:
        ci.run_code("1 + 1", language="javascript")
    assert "400" in repr(e.value) or type(e.value).__name__ == "InvalidArgumentException"
    with pytest.raises(Exception, match="needs node"):
        ci.create_code_context(language="js")
    with pytest.raises(Exception, match="only python, bash and javascript"):
        ci.run_code("1", language="r")


def test_a_context_never_runs_code_as_another_account_than_asked(e2b_url: str, ci: Sandbox) -> None:
    """The default context runs as the account that started it (E2B's ``user``); a request naming another account
    (envd's ``Authorization: Basic``) is a 400, never a run as the context's account."""
    import base64

    assert ci.run_code("import os\nos.getuid()").text == "1000"
    headers = {"E2b-Sandbox-Id": ci.sandbox_id, "X-Access-Token": envd_token(ci) or "",
               "E2b-Sandbox-Port": "49999", "Authorization": "Basic " + base64.b64encode(b"root:").decode()}
    r = httpx.post(f"{e2b_url}/execute", headers=headers, json={"code": "import os\nos.getuid()"})
    assert r.status_code == 400 and "runs as user, not root" in r.json()["message"], r.text
    r = httpx.post(f"{e2b_url}/contexts", headers=headers, json={"language": "python"})
    ctx = r.json()["id"]  # a context made as root runs as root
    r = httpx.post(f"{e2b_url}/execute", headers=headers, json={"code": "import os\nos.getuid()", "context_id": ctx})
    assert r.status_code == 200 and '"text": "0"' in r.text, r.text
