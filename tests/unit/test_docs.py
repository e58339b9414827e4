"""The README and docs/ stay true: every Python and shell block runs or says why it cannot (tests/docblocks.py),
links resolve, every page is in the nav and linked from the index, the site builds.

This file runs the blocks marked ``run`` (no Docker, no server) and checks every skipped one;
tests/integration/test_docs_run.py runs the ``sandbox`` ones.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sybil import Example

from tests import docblocks
from tests.docblocks import PAGES, ROOT, SKIP_REASONS, Block

EXAMPLES = docblocks.all_examples()
BLOCKS: list[Block] = [ex.parsed for ex in EXAMPLES]


def test_every_block_is_marked_with_a_known_reason() -> None:
    """A Python or shell block without a marker, with an unknown one, or skipped for a reason not on the closed
    list fails, naming the page and line."""
    problems = [p for b in BLOCKS if (p := b.problem())]
    assert not problems, "\n".join(problems)


def test_every_tier_and_reason_is_used() -> None:
    """Both tiers run blocks and no reason stays on the list unused; the counts are printed (``pytest -s``)."""
    c = docblocks.counts(BLOCKS)
    print("\ndocs blocks:", ", ".join(f"{k} {v}" for k, v in c.items()))
    assert c.get("run") and c.get("sandbox"), f"expected blocks run in both tiers, found {c}"
    unused = sorted(r for r in SKIP_REASONS if f"skip:{r}" not in c)
    assert not unused, f"remove the unused skip reasons from tests/docblocks.py: {unused}"


def test_markers_refuse_what_is_not_on_the_list() -> None:
    """The checks above can fail: an unmarked block, an unknown reason, a reason on a run block, a marked output."""
    page = ROOT / "docs" / "x.md"
    assert "needs a marker" in str(Block(page, 1, "python", "", None, None).problem())
    assert "not one of" in str(Block(page, 1, "bash", "", "skip", "flaky").problem())
    assert "takes no reason" in str(Block(page, 1, "python", "", "run", "gpu").problem())
    assert "unknown marker" in str(Block(page, 1, "sh", "", "check", None).problem())
    assert "drop the marker" in str(Block(page, 1, "yaml", "", "run", None).problem())
    assert Block(page, 1, "python", "", "skip", "gpu").problem() is None
    assert Block(page, 1, "yaml", "", None, None).problem() is None


def _params(*marks: str) -> list[object]:
    return [pytest.param(ex, id=ex.parsed.id) for ex in EXAMPLES if ex.parsed.needs_mark and ex.parsed.mark in marks]


@pytest.mark.parametrize("example", _params("run"))
def test_run_block(example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``run`` block executes, in a scratch folder that links the repository's entries."""
    monkeypatch.chdir(docblocks.scratch(tmp_path))
    example.evaluate()


@pytest.mark.parametrize("example", _params("skip"))
def test_skipped_block_still_compiles(example: Example) -> None:
    """A skipped Python block compiles and what it imports from this repository exists."""
    example.evaluate()


def test_a_skipped_block_with_a_wrong_import_fails() -> None:
    bad = Block(ROOT / "README.md", 1, "python", "from agentenv import NoSuchThing\n", "skip", "gpu")
    with pytest.raises(AssertionError, match="has no NoSuchThing"):
        docblocks.check_skipped(bad)
    with pytest.raises(SyntaxError):
        docblocks.check_skipped(Block(ROOT / "README.md", 1, "python", "def (:\n", "skip", "gpu"))


INDENTED_COMMAND = re.compile(r"^(?: {4,}|\t)(?:agentenv|python3?|pip|bash|sh|sudo|docker|curl|export|\.venv/\S+"
                              r"|[A-Z_]+=\S*)\s", re.M)
FENCED = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.S | re.M)


def indented_commands(text: str) -> list[str]:
    """Command lines in indented (unfenced) code blocks: no marker can be put on them, so none may exist."""
    return [m.group(0).strip() for m in INDENTED_COMMAND.finditer(FENCED.sub("", text))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_are_in_fenced_blocks(page: Path) -> None:
    """A command shown in an indented code block would escape the markers; fence it (```bash) and mark it."""
    found = indented_commands(page.read_text())
    assert not found, f"{page.name}: put these commands in a fenced, marked block: {found}"


def test_an_indented_command_is_found() -> None:
    assert indented_commands("text\n\n    python -m envs.tasks validate\n") == ["python"]
    assert indented_commands("text\n\n```bash\n    python -m envs.tasks validate\n```\n") == []


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(page: Path) -> None:
    """Every relative link of a page points at a file that exists (anchors and web links are not checked)."""
    missing = [t for t in _links(page) if not (page.parent / t.split("#", 1)[0]).exists()]
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


DOC_PAGES = [p for p in PAGES if p.parent != ROOT]


def test_docs_pages_are_in_the_nav() -> None:
    """Each docs/ page is listed in mkdocs.yml's nav (strict mode only warns about orphans as INFO)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    orphans = [str(p.relative_to(ROOT / "docs")) for p in DOC_PAGES
               if f" {p.relative_to(ROOT / 'docs')}" not in nav]
    assert not orphans, f"add these pages to the nav in mkdocs.yml: {orphans}"


def test_the_index_links_every_page() -> None:
    """docs/index.md links every other page of docs/, so a reader of the index finds each."""
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / t.split("#", 1)[0]).resolve() for t in _links(index)}
    unlinked = [str(p.relative_to(ROOT / "docs")) for p in DOC_PAGES if p != index and p.resolve() not in linked]
    assert not unlinked, f"link these pages from docs/index.md: {unlinked}"


def _commands() -> dict[tuple[str, ...], dict[str, list[str]]]:
    """Each command of this repository the docs' shell blocks name (program and subcommand words): the flags they pass
    it, and where."""
    found: dict[tuple[str, ...], dict[str, list[str]]] = {}
    for b in BLOCKS:
        for prog, path, flags in docblocks.commands(b):
            for flag in (*flags, ""):
                found.setdefault((*prog, *path), {}).setdefault(flag, []).append(b.id)
    return found


COMMANDS = _commands()


@functools.cache
def _help(command: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    env = {**docblocks.shell_env(), "COLUMNS": "300", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run([*command, "--help"], capture_output=True, text=True, env=env, timeout=120, check=False)


def test_the_docs_name_commands() -> None:
    """The check below has commands to check (skipped blocks included: they are not run, so this is their test)."""
    expected = {("agentenv", "serve"), ("agentenv", "train"), ("agentenv", "rollout"),
                ("agentenv", "tasks", "validate")}
    assert expected <= set(COMMANDS), sorted(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_commands_and_flags_in_the_docs_exist(command: tuple[str, ...]) -> None:
    """Every command of this repository in a shell block, run or skipped, exists and takes every ``--flag`` it is
    given there (read from its ``--help``)."""
    r = _help(command)
    where = sorted({w for ids in COMMANDS[command].values() for w in ids})
    assert r.returncode == 0, f"`{' '.join(command)}` (in {where}) does not exist:\n{r.stdout}{r.stderr}"
    missing = {f: ids for f, ids in COMMANDS[command].items()
               if f and not re.search(rf"(?<![\w-]){f}(?![\w-])", r.stdout)}
    assert not missing, f"`{' '.join(command)}` takes no {sorted(missing)}; fix the docs at {missing}"


def test_a_wrong_command_or_flag_is_caught() -> None:
    """The flag check can fail: a flag no command takes is not found in a help text, a missing command exits non-zero."""
    bash = "agentenv serve \\\n  [--no-such-flag X]\n.venv/bin/python -m envs.tasks validate --tasks t.jsonl\n"
    assert docblocks.commands(Block(ROOT / "x.md", 1, "bash", bash, "skip", "gpu")) == [
        (("agentenv",), ("serve",), ("--no-such-flag",)),
        (("python", "-m", "envs.tasks"), ("validate",), ("--tasks",))]
    assert "--token-file" in _help(("agentenv", "serve")).stdout
    assert "--no-such-flag" not in _help(("agentenv", "serve")).stdout
    assert _help(("agentenv", "no-such-command")).returncode != 0
