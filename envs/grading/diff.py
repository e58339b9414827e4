"""A git diff read as data: its ``diff --git`` sections, each parsed into the paths it names, its modes and the
lines it adds (``FileChange``), and ``git apply --numstat -z`` output (the files git will touch). Nothing here
decides anything: what is graded is ``envs.grading.patch``'s rule over these."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FileChange:
    """One ``diff --git`` section: the paths it names, its modes, and the lines it adds."""

    text: bytes
    paths: tuple[str, ...]               # every path the section's headers name (old and new)
    new_file: bool = False
    deleted: bool = False
    new_mode: str = ""
    binary: bool = False
    added: tuple[str, ...] = ()          # added lines (decoded), binary payloads excepted
    problem: str = ""                    # why the section does not parse ("" when it does)

    @property
    def path(self) -> str:
        return self.paths[-1] if self.paths else ""


_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def unquote(name: str) -> str | None:
    """A path as git writes it in a header: C-quoted (``"a/t\\303\\251st"``) or plain; None when malformed."""
    if not name.startswith('"'):
        return name
    if len(name) < 2 or not name.endswith('"'):
        return None
    body, out, i = name[1:-1], bytearray(), 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode("utf-8", "surrogateescape")
            i += 1
            continue
        if i + 1 >= len(body):
            return None
        n = body[i + 1]
        if n in _ESCAPES:
            out.append(_ESCAPES[n])
            i += 2
        elif re.fullmatch(r"[0-7]{3}", body[i + 1:i + 4]):
            out.append(int(body[i + 1:i + 4], 8))
            i += 4
        else:
            return None
    return out.decode("utf-8", "surrogateescape")


def _strip_prefix(name: str | None, prefix: str) -> str | None:
    if name is None:
        return None
    if name == "/dev/null":
        return ""
    return name[len(prefix):] if name.startswith(prefix) else None


def _header_pair(rest: str) -> tuple[str, str] | None:
    """``a/X b/Y`` of a ``diff --git`` line (names quoted or not); None when it cannot be split."""
    if rest.startswith('"'):
        m = re.match(r'("(?:[^"\\]|\\.)*") (.+)$', rest)
        if not m:
            return None
        a, b = unquote(m.group(1)), unquote(m.group(2))
    else:
        m = re.match(r'(.+?) ("(?:[^"\\]|\\.)*")$', rest)
        if m:
            a, b = m.group(1), unquote(m.group(2))
        else:  # unquoted both: the same name twice ("a/X b/X"), or two names split by the one " b/"
            half = (len(rest) - 1) // 2
            if len(rest) % 2 == 1 and rest[half] == " " and rest[:half][2:] == rest[half + 1:][2:]:
                a, b = rest[:half], rest[half + 1:]
            elif rest.count(" b/") == 1:
                a, b = rest[:rest.index(" b/")], rest[rest.index(" b/") + 1:]
            else:
                return None
    a, b = _strip_prefix(a, "a/"), _strip_prefix(b, "b/")
    return None if not a or not b else (a, b)


def _line_name(value: str) -> str:
    """The name of a ``---``/``+++``/``rename from`` value (git ends names holding spaces with a tab)."""
    if value.startswith('"'):
        return value.rstrip("\t")
    return value.split("\t", 1)[0]


def parse_section(text: bytes) -> FileChange:
    """One ``diff --git`` section (see ``FileChange``)."""
    lines = text.decode("utf-8", "surrogateescape").split("\n")
    paths: list[str] = []
    problem = ""
    pair = _header_pair(lines[0][len("diff --git "):])
    if pair is None:
        problem = "its diff --git line names no file"
    else:
        paths += pair
    new_file = deleted = binary = False
    new_mode = ""
    added: list[str] = []
    in_header = True
    for line in lines[1:]:
        if in_header:
            if line.startswith("@@"):
                in_header = False
            elif line.startswith(("--- ", "+++ ")):
                name = unquote(_line_name(line[4:]))
                stripped = _strip_prefix(name, "a/" if line[0] == "-" else "b/")
                if stripped is None:
                    problem = problem or f"a malformed {line[:3]} line"
                elif stripped:
                    paths.append(stripped)
            elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
                name = unquote(_line_name(line.split(" ", 2)[2]))
                if name is None:
                    problem = problem or "a malformed rename/copy line"
                else:
                    paths.append(name)
            elif line.startswith("new file mode "):
                new_file, new_mode = True, line.split()[-1]
            elif line.startswith("deleted file mode "):
                deleted = True
            elif line.startswith("new mode "):
                new_mode = line.split()[-1]
            elif line.startswith(("GIT binary patch", "Binary files ")):
                binary, in_header = True, False
            elif line.startswith(("old mode ", "index ", "similarity index ", "dissimilarity index ")) or not line:
                pass
            else:
                problem = problem or f"an unknown header line {line[:60]!r}"
            continue
        if line.startswith("GIT binary patch"):
            binary = True
        if line.startswith("+"):
            added.append(line[1:])
    return FileChange(text=text, paths=tuple(dict.fromkeys(paths)), new_file=new_file, deleted=deleted,
                      new_mode=new_mode, binary=binary, added=tuple(added), problem=problem)


def split_sections(patch: bytes) -> tuple[bytes, list[bytes]]:
    """(text before the first ``diff --git`` line, one bytes per section)."""
    starts = [m.start() for m in re.finditer(rb"(?m)^diff --git ", patch)]
    if not starts:
        return patch, []
    bounds = [*starts, len(patch)]
    return patch[:starts[0]], [patch[bounds[i]:bounds[i + 1]] for i in range(len(starts))]


@dataclass(frozen=True)
class NumstatEntry:
    paths: tuple[str, ...]
    binary: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def parse_numstat(data: bytes) -> list[NumstatEntry] | None:
    """``git apply --numstat -z`` output: one entry per file git will touch (renames name two); None if malformed."""
    items = data.split(b"\0")
    out: list[NumstatEntry] = []
    i = 0
    while i < len(items) and items[i]:
        fields = items[i].split(b"\t", 2)
        if len(fields) != 3:
            return None
        binary = fields[0] == b"-"
        if fields[2]:
            out.append(NumstatEntry((fields[2].decode("utf-8", "surrogateescape"),), binary))
            i += 1
        else:  # a rename or copy: the two names follow
            if i + 2 >= len(items):
                return None
            out.append(NumstatEntry((items[i + 1].decode("utf-8", "surrogateescape"),
                                     items[i + 2].decode("utf-8", "surrogateescape")), binary))
            i += 3
    return out
