"""R2E-Gym's gold patch: its rows carry the fixing commit as a parsed structure (``parsed_commit_content``, the JSON
of ``r2egym.commit_models.diff_classes.ParsedCommit``), not as a diff. The gold patch is what R2E-Gym's
``ParsedCommit.get_patch(test_file=False)`` writes: the diffs of the commit's Python files that are not test files,
each as git prints it (header, index line, ``---`` / ``+++``, hunks)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# a line's mark in a hunk, by R2E-Gym's LineType
_MARKS = {"context": " ", "added": "+", "deleted": "-", "note": "\\ "}


def is_test_file(path: str) -> bool:
    """R2E-Gym's ``FileDiff.is_test_file``: the files its gold patch leaves out."""
    parts = path.split("/")
    return (path.endswith("_test.py") or path.startswith("test_") or parts[-1].startswith("test_")
            or any(p in parts for p in ("tests", "Tests", "test", "Test")))


def _range(r: Mapping[str, Any]) -> str:
    return f"{r['start']}" if r.get("length") is None else f"{r['start']},{r['length']}"


def file_patch(fd: Mapping[str, Any]) -> str:
    """One file's diff, as R2E-Gym's ``FileDiff.get_patch`` writes it."""
    path = fd["header"]["file"]["path"]
    out = [f"diff --git a/{path} b/{path}\n"]
    if fd["header"].get("misc_line"):
        out.append(fd["header"]["misc_line"] + "\n")
    if fd.get("index_line"):
        il = fd["index_line"]
        out.append(f"index {il['old_commit_hash']}..{il['new_commit_hash']}{' ' if il.get('mode') else ''}"
                   f"{il.get('mode') or ''}\n")
    if fd.get("is_binary_file"):
        out.append(f"{fd.get('binary_line') or ''}\n")
    if fd.get("minus_file") and fd.get("plus_file"):
        out.append(f"--- {fd['minus_file']['path']}\n+++ {fd['plus_file']['path']}\n")
    for hunk in fd.get("hunks") or []:
        d = hunk["descriptor"]
        out.append(f"@@ -{_range(d['old_range'])} +{_range(d['new_range'])} @@"
                   + (f" {d['section']}" if d.get("section") else "") + "\n")
        for line in hunk["line_group"]["all_lines"]:
            out.append(f"{_MARKS[line['type']]}{line['content']}\n")
    return "".join(out)


def gold_patch(parsed: Mapping[str, Any]) -> str:
    """The gold patch of a ParsedCommit: its non-test Python files' diffs, in order; ValueError when the structure
    is not R2E-Gym's."""
    try:
        diffs = [fd for fd in parsed["file_diffs"] if str(fd["header"]["file"]["path"]).endswith(".py")
                 and not is_test_file(str(fd["header"]["file"]["path"]))]
        return "".join(file_patch(fd) for fd in diffs)
    except (KeyError, TypeError) as e:
        raise ValueError(f"is not R2E-Gym's ParsedCommit (no {e})") from None
