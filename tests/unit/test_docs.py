"""The README and docs/ stay true: marked code blocks run (or compile and import), links resolve, the site builds.

A block is marked by an HTML comment on the line before its fence (docs/index.md, "Code blocks that are
tested"): ``<!-- run -->`` is executed, ``<!-- check -->`` (needs Docker or servers) is compiled and its imports
resolved, including every name of each ``from X import Y``.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
MARK = re.compile(r"^<!--\s*(run|check)\s*-->\s*$")


def marked_blocks(page: Path) -> list[tuple[str, int, str, str]]:
    """(mark, line, language, code) of each fenced block whose previous line is a run/check marker."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        mark = MARK.match(lines[start - 1]) if start else None
        if mark:
            out.append((mark.group(1), start + 1, lang, "\n".join(body) + "\n"))
    return out


BLOCKS = [pytest.param(mark, lang, code, id=f"{p.relative_to(ROOT)}:{line}:{mark}")
          for p in PAGES for mark, line, lang, code in marked_blocks(p)]


def test_some_blocks_are_marked() -> None:
    """The tour and the convention's example are marked, so this test cannot pass by finding nothing."""
    marks = {b.values[0] for b in BLOCKS}
    assert marks == {"run", "check"}, f"expected both marks in README/docs, found {marks}"


@pytest.mark.parametrize(("mark", "lang", "code"), BLOCKS)
def test_marked_block(mark: str, lang: str, code: str) -> None:
    """A ``run`` block executes; a ``check`` block compiles and everything it imports exists."""
    assert lang == "python", f"only python blocks can be marked, this one is {lang!r}"
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            assert node.module and node.level == 0, "docs import absolute modules only"
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}: fix the docs"
    compiled = compile(tree, "<docs block>", "exec")
    if mark == "run":
        exec(compiled, {"__name__": "__docs__"})  # noqa: S102 - our own documentation's code


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(page: Path) -> None:
    """Every relative link of a page points at a file that exists (anchors and web links are not checked)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    missing = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to missing files: {missing}"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict`` succeeds: every page is in the nav, every link and anchor resolves."""
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (scripts/bootstrap.sh installs it)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1",
                                                                      "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "site" / "training" / "index.html").exists()


def test_docs_pages_are_in_the_nav() -> None:
    """Each docs/*.md page is listed in mkdocs.yml's nav (strict mode only warns about orphans as INFO)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    orphans = [p.name for p in PAGES[1:] if f" {p.name}" not in nav]
    assert not orphans, f"add these pages to the nav in mkdocs.yml: {orphans}"
