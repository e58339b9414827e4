"""The reverse of a unified diff (git's format): what ``git apply -R`` applies, as a diff of its own.

SWE-smith publishes the patch that *introduces* each bug; its gold fix is that patch reversed. Offline (its
instance branches live on GitHub) the bug patch is applied at reset and the reverse is what grading and
``validate`` apply as the gold patch. Reversing swaps each file's old and new side: ``---`` / ``+++`` paths,
``new file`` / ``deleted file``, ``old mode`` / ``new mode``, ``rename from`` / ``rename to``, the ``index`` line's
hashes, each hunk's ranges, and its ``-`` / ``+`` lines (removals written first, as git does). Binary patches and
copies have no text reverse here: DiffError.
"""

from __future__ import annotations

import re

_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)")
_INDEX = re.compile(r"index ([0-9a-f]+)\.\.([0-9a-f]+)(.*)")
_SWAPS = {"new file mode ": "deleted file mode ", "deleted file mode ": "new file mode ",
          "rename from ": "rename to ", "rename to ": "rename from "}


class DiffError(ValueError):
    """A diff that cannot be reversed as text (binary, a copy) or is malformed (a hunk shorter than its header)."""


def _count(s: str | None) -> int:
    return 1 if s is None else int(s)


def _range(start: str, count: str | None) -> str:
    return start if count is None else f"{start},{count}"


def _hunk(lines: list[str], i: int, old: int, new: int) -> tuple[list[str], int]:
    """The reversed body of a hunk starting at ``lines[i]`` with ``old`` / ``new`` lines; and where it ends."""
    out: list[str] = []
    minus: list[str] = []  # a run of changes, reversed: its removals, then its additions
    plus: list[str] = []
    last: list[str] | None = None
    while i < len(lines) and (old > 0 or new > 0 or lines[i].startswith("\\")):
        line = lines[i]
        mark = line[:1]
        if mark == "\\":
            if last is None:
                raise DiffError(f"a '\\' line with no line before it: {line.rstrip()!r}")
            last.append(line)
        elif mark == "-":
            old -= 1
            plus.append("+" + line[1:])
            last = plus
        elif mark == "+":
            new -= 1
            minus.append("-" + line[1:])
            last = minus
        elif mark in (" ", "\n", "\r"):
            old, new = old - 1, new - 1
            out += minus + plus
            minus, plus = [], []
            out.append(line)
            last = out
        else:
            break
        i += 1
    if old or new:
        raise DiffError(f"a hunk ends {max(old, new)} line(s) short of its header")
    return out + minus + plus, i


def reverse_diff(patch: str) -> str:
    """``patch`` reversed (see the module doc)."""
    lines = patch.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("GIT binary patch", "Binary files ")):
            raise DiffError("a binary patch has no text reverse here")
        if line.startswith(("copy from ", "copy to ")):
            raise DiffError("a copy has no reverse as a diff of the same files")
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = line[4:], lines[i + 1][4:]
            out += ["--- " + _side(new, "a/"), "+++ " + _side(old, "b/")]
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            a, b, c, d, rest = m.groups()
            out.append(f"@@ -{_range(c, d)} +{_range(a, b)} @@{rest}" + ("\n" if line.endswith("\n") else ""))
            body, i = _hunk(lines, i + 1, _count(b), _count(d))
            out += body
            continue
        if line.startswith("old mode ") and i + 1 < len(lines) and lines[i + 1].startswith("new mode "):
            out += ["old mode " + lines[i + 1][9:], "new mode " + line[9:]]
            i += 2
            continue
        if line.startswith("rename from ") and i + 1 < len(lines) and lines[i + 1].startswith("rename to "):
            out += ["rename from " + lines[i + 1][10:], "rename to " + line[12:]]
            i += 2
            continue
        if line.startswith("diff --git "):
            out.append(_git_header(line, lines[i + 1:]))
        elif (m := _INDEX.match(line)) is not None:
            out.append(f"index {m[2]}..{m[1]}{m[3]}" + ("\n" if line.endswith("\n") else ""))
        else:
            out.append(next((new + line[len(old):] for old, new in _SWAPS.items() if line.startswith(old)), line))
        i += 1
    return "".join(out)


def _side(header: str, prefix: str) -> str:
    """A ``---`` / ``+++`` path moved to the other side: ``a/x`` <-> ``b/x`` (``/dev/null`` stays)."""
    if header.startswith(("a/", "b/")):
        return prefix + header[2:]
    return header


def _git_header(line: str, rest: list[str]) -> str:
    """``diff --git a/X b/Y`` with its sides swapped (X and Y read from the rename lines when they differ)."""
    old = next((r[12:].rstrip("\n") for r in rest[:6] if r.startswith("rename from ")), None)
    new = next((r[10:].rstrip("\n") for r in rest[:6] if r.startswith("rename to ")), None)
    if old is not None and new is not None:
        return f"diff --git a/{new} b/{old}\n"
    return line  # the same path on both sides: nothing to swap
