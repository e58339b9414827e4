"""The code blocks of README.md and docs/: which ones run, where, and why the others cannot run here.

Sybil (``sybil.Document`` and its Markdown fence lexer) finds the blocks; this module reads the marker on the line
before each fence and evaluates the block. Every Python or shell block carries one (docs/index.md, "Code blocks
that are tested"):

- ``<!-- test: run -->``: executed by ``tests/unit/test_docs.py``: needs no Docker and no server.
- ``<!-- test: sandbox -->``: executed by ``tests/integration/test_docs_run.py``, on real Docker and CRIU; it must
  close every sandbox it makes (users copy it).
- ``<!-- test: skip REASON -->``: not executed, for a reason of ``SKIP_REASONS`` (a closed list: a new reason is a
  change to this file, reviewed); a skipped Python block still compiles, and what it imports from this repository
  exists.

Every command line of a shell block that runs this repository's command line (``agentenv``, ``python -m envs.tasks``,
...), run or skipped, names a command that exists with flags it takes (``commands``; tests/unit/test_docs.py reads
each one's ``--help``).

Each block runs on its own (a fresh namespace, or a fresh shell) in a scratch folder that links the repository's
top-level entries, so ``trainer/configs/main.toml`` resolves and nothing a block writes lands in the checkout.
``python tests/docblocks.py`` prints how many blocks run in each tier and how many are skipped per reason.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from sybil import Document, Example, Region
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON, SHELL = frozenset({"python", "py"}), frozenset({"bash", "sh", "shell"})
TIERS = ("run", "sandbox")
SKIP_REASONS = {
    "readme-command": "the README's two commands: they bootstrap the host and are CI itself",
    "gpu": "needs a GPU, or a model served on one",
    "remote-host": "needs other machines: a Ray cluster, servers at other addresses, a shared mount",
    "long-running": "takes minutes or more (training, a whole test suite), or serves until stopped (a server)",
    "needs-network": "downloads from the internet (pip, a Git clone), which CI cannot reach",
    "needs-server": "talks to a server the reader started (agentenv serve, the LLM gateway) and has no way to "
                    "stop it; docs/quickstart.md starts and stops one",
    "framework": "runs inside another program's run (a trainer, an inspect-ai sample, an OpenAI-compatible "
                 "server of one's own) or needs one the test environment does not install (verl, OpenRLHF, harbor)",
    "excerpt": "a few lines of a larger program shown on the same page: the names it uses come from there",
}
MARK = re.compile(r"^\s*<!--\s*test:\s*(?P<mark>[\w-]+)(?:\s+(?P<reason>[\w-]+))?\s*-->\s*$")
FIRST_PARTY = frozenset({"agentenv", "envs", "policy", "rollout", "trainer"})
SHELL_TIMEOUT_S = 240


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and code, and its marker (``mark`` None when unmarked)."""

    page: Path
    line: int
    language: str
    source: str
    mark: str | None
    reason: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def needs_mark(self) -> bool:
        return self.language in PYTHON | SHELL

    def problem(self) -> str | None:
        """What is wrong with the block's marker, or None."""
        if self.mark is None:
            return (f"{self.id}: a {self.language} block needs a marker on the line before its fence: "
                    f"<!-- test: run -->, <!-- test: sandbox --> or <!-- test: skip REASON -->") \
                if self.needs_mark else None
        if not self.needs_mark:
            return f"{self.id}: only Python and shell blocks are run; drop the marker of this {self.language!r} block"
        if self.mark in TIERS:
            return f"{self.id}: <!-- test: {self.mark} --> takes no reason" if self.reason else None
        if self.mark != "skip":
            return f"{self.id}: unknown marker {self.mark!r}: run, sandbox or skip REASON"
        if self.reason not in SKIP_REASONS:
            return (f"{self.id}: skip reason {self.reason!r} is not one of {sorted(SKIP_REASONS)}; make the block "
                    f"run, or add the reason to SKIP_REASONS in tests/docblocks.py with why")
        return None


def _marked(document: Document) -> Iterator[Region]:
    """Sybil parser: every fenced block with a language, its Block as the region's ``parsed``."""
    for region in FencedCodeBlockLexer(language=r"[\w+-]+")(document):
        before = document.text[:region.start].rstrip(" \t")
        line = before.count("\n") + 1
        previous = before.rstrip("\n").rsplit("\n", 1)[-1] if before.endswith("\n") else ""
        m = MARK.match(previous)
        region.parsed = Block(Path(document.path), line, str(region.lexemes["language"]),
                              str(region.lexemes["source"]), m and m.group("mark"), m and m.group("reason"))
        region.evaluator = evaluate
        yield region


def examples(page: Path) -> list[Example]:
    return list(Document.parse(str(page), _marked))


def all_examples() -> list[Example]:
    return [ex for page in PAGES for ex in examples(page)]


def blocks() -> list[Block]:
    return [ex.parsed for ex in all_examples()]


def counts(found: list[Block]) -> dict[str, int]:
    """How many Python/shell blocks each tier runs and each skip reason skips (``skip:REASON``)."""
    c = Counter(b.mark if b.mark in TIERS else f"skip:{b.reason}" for b in found if b.needs_mark)
    return dict(sorted(c.items()))


def evaluate(example: Example) -> None:
    """Sybil evaluator: run a run/sandbox block, check a skipped one; run in ``os.getcwd()`` (the test's scratch)."""
    block: Block = example.parsed
    if block.mark == "skip":
        check_skipped(block)
    elif block.language in PYTHON:
        code = compile(_at_line(block), str(block.page), "exec", dont_inherit=True)
        exec(code, {"__name__": "__docs__"})  # noqa: S102 - our own documentation's code
    else:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block.source], capture_output=True, text=True,
                           timeout=SHELL_TIMEOUT_S, env=shell_env(), check=False)
        assert r.returncode == 0, f"{block.id} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _at_line(block: Block) -> str:
    """The block's code, padded so that a traceback names its line in the page."""
    return "\n" * block.line + block.source


def check_skipped(block: Block) -> None:
    """A skipped Python block compiles (top-level ``await`` allowed: it may be a coroutine's body) and every
    module it imports from this repository, and every name it takes from one, exists."""
    if block.language not in PYTHON:
        return
    tree = compile(_at_line(block), str(block.page), "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                   dont_inherit=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FIRST_PARTY:
                    _import(block, alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FIRST_PARTY:
            assert node.level == 0, f"{block.id}: docs import absolute modules only"
            module = _import(block, str(node.module))
            for alias in node.names:
                assert module is None or hasattr(module, alias.name), \
                    f"{block.id}: {node.module} has no {alias.name}: fix the docs"


def _import(block: Block, name: str) -> ModuleType | None:
    """The module, or None when it needs a framework this environment lacks (a block skipped as ``framework``)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if block.reason == "framework" and (e.name or "").split(".")[0] not in FIRST_PARTY:
            return None
        raise


SEPARATORS = re.compile(r"&&|\|\||[;&|]")
WORD = re.compile(r"^[a-z][a-z-]*$")


Command = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # program, subcommand words, flags


def commands(block: Block) -> list[Command]:
    """Each command line of a shell block, run or not, that runs this repository's command line (``agentenv ...``,
    ``python -m envs.tasks ...``, ``python -m bench.X ...``): (the program, the words that may name its subcommand,
    the ``--flags`` it passes). Continuations are joined, comments dropped, ``[--opt X]`` read as ``--opt X``."""
    if block.language not in SHELL:
        return []
    out: list[Command] = []
    for line in block.source.replace("\\\n", " ").splitlines():
        for part in SEPARATORS.split(re.sub(r"(^|\s)#.*", "", line)):
            words = [w.strip("[]") for w in part.split() if "=" not in w.split("--")[0] or w.startswith("--")]
            prog: tuple[str, ...]
            if words[:1] == ["agentenv"]:
                prog, rest = ("agentenv",), words[1:]
            elif (len(words) > 2 and Path(words[0]).name.startswith("python") and words[1] == "-m"
                  and words[2].split(".")[0] in FIRST_PARTY | {"bench"}):
                prog, rest = ("python", "-m", words[2]), words[3:]
            else:
                continue
            flags = tuple(sorted({w.split("=", 1)[0] for w in rest if w.startswith("--") and len(w) > 2}))
            out.append((prog, tuple(_leading(rest)), flags))
    return out


def _leading(words: list[str]) -> Iterator[str]:
    for w in words:
        if not WORD.match(w):
            return
        yield w


def shell_env() -> dict[str, str]:
    """A shell block's environment: this interpreter's scripts first on PATH (``agentenv``), this checkout first on
    the module path."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def scratch(folder: Path) -> Path:
    """``folder`` with a link to each of the repository's top-level entries: where a block runs."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith("."):
            (folder / entry.name).symlink_to(entry)
    return folder


if __name__ == "__main__":
    for what, n in counts(blocks()).items():
        print(f"{what:24} {n}")
