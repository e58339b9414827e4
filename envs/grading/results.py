"""Reading a test run's results: pytest's JUnit XML (what a grade rests on) and its ``-rA`` text summary.

The grader asks pytest for a JUnit XML file at a path it chose (``--junitxml``, family ``xunit1``) and
reads test statuses from there: ``parse_junit``. The text a run prints is read only for what the
XML cannot say — failure messages and the log tail that ``info`` shows, and whether a test that the
XML calls passed was an unexpected pass of an ``xfail`` test (``XPASS``, which does not count as a
pass). Text can therefore only make a result worse, never better: code under test that prints
``PASSED ...`` lines gains nothing.

Test ids are pytest node ids, ``path/to/test_file.py::Class::test_name[params]``. The XML names a
test by ``classname`` and ``name``, which pytest derives from the node id (``mangle_test_address``:
the path becomes dotted and loses ``.py``, classes follow, the name keeps its parameters); the
parser maps them back by computing the same pair for every id it is asked about, so ids with
``::``, ``]``, `` - `` or spaces inside their parameters come back exactly. Statuses are those of
SWE-bench: PASSED, FAILED, ERROR, SKIPPED, XFAIL, XPASS; PASSED and XFAIL count as passing. A test
that appears twice (a failure in its call and an error in its teardown) keeps its worst status.

``parse_pytest`` reads the ``-rA`` short summary; ``split_message`` cuts its lines into id and message
(the id may hold `` - `` and ``]`` inside its brackets).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PASSING = frozenset({"PASSED", "XFAIL"})
STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
MAX_RESULT_BYTES = 32 << 20  # a JUnit file larger than this is refused (thousands of tests take a few MB)
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+)$")
_RANK = {"PASSED": 0, "XFAIL": 1, "SKIPPED": 2, "XPASS": 3, "ERROR": 4, "FAILED": 5}
_XPASS_STRICT = "xfail-marked test passes unexpectedly"


class ResultFileError(ValueError):
    """The result file is not one pytest wrote (too large, a DTD, not XML)."""


# --- the text summary ------------------------------------------------------------------------------


def split_message(rest: str, known: Iterable[str] = (), *, space_ends_id: bool = False) -> tuple[str, str]:
    """``'path::test[params] - message'`` -> (test id, message).

    A known id the line starts with wins (the longest). Otherwise the id's parameters run from its first
    ``[`` to the matching ``]`` that is followed by the end or `` - `` (so `` - `` and ``]`` may occur
    inside the brackets and in the message); an id without parameters ends at the first `` - ``.
    ``space_ends_id``: an id also ends at a space (pytest's older ``XPASS id reason`` lines).
    """
    best = ""
    for k in known:
        if len(k) > len(best) and (rest == k or rest.startswith(k + " - ")
                                   or (space_ends_id and rest.startswith(k + " "))):
            best = k
    if best:
        return best, rest[len(best):].removeprefix(" - ").lstrip() if rest != best else ""
    seps = (" - ", " ") if space_ends_id else (" - ",)

    def ends_at(i: int) -> bool:  # rest[i] == "]" closes the id
        tail = rest[i + 1:]
        return tail == "" or tail.startswith(seps)

    open_at = rest.find("[")
    dash = rest.find(" - ")
    if open_at >= 0 and (dash < 0 or open_at < dash):
        depth, close = 0, -1
        for i in range(open_at, len(rest)):
            if rest[i] == "[":
                depth += 1
            elif rest[i] == "]":
                depth -= 1
                if depth == 0:
                    close = i
                    break
        if close < 0 or not ends_at(close):  # unbalanced brackets: the first "]" that can end an id
            close = next((i for i in range(open_at, len(rest)) if rest[i] == "]" and ends_at(i)), -1)
        if close >= 0:
            return rest[:close + 1], rest[close + 1:].removeprefix(" - ").lstrip()
        return rest, ""
    cuts = [i for i in (dash, rest.find(" ") if space_ends_id else -1) if i >= 0]
    if not cuts:
        return rest, ""
    cut = min(cuts)
    return rest[:cut], rest[cut:].removeprefix(" - ").lstrip()


def _summary_lines(log: str) -> Iterable[tuple[str, str]]:
    for line in log.splitlines():
        m = _SUMMARY.match(line.rstrip())
        if m:
            yield m.group(1), m.group(2)


def parse_pytest(log: str, known: Iterable[str] = ()) -> dict[str, str]:
    """Test id -> status from pytest's ``-rA`` short summary (PASSED/FAILED/ERROR/XFAIL/XPASS lines).

    ``known``: ids the caller expects (they are matched whole, whatever their parameters hold). A
    file-level ERROR (a collection error) is kept under the file's path; a teardown error after a pass
    makes the test an ERROR, after a failure the failure stays.
    """
    ids = list(known)
    out: dict[str, str] = {}
    for status, rest in _summary_lines(log):
        test_id = rest if status == "PASSED" else split_message(rest, ids, space_ends_id=status == "XPASS")[0]
        if out.get(test_id) in ("FAILED", "ERROR") and status == "ERROR":
            continue  # a teardown error after a failure: keep the failure
        if out.get(test_id) == "PASSED" and status == "ERROR":
            out[test_id] = "ERROR"  # passed, then its teardown failed
            continue
        out.setdefault(test_id, status)
    return out


def failure_messages(log: str, known: Iterable[str] = ()) -> dict[str, str]:
    """Test id -> the one-line message of each FAILED/ERROR line in pytest's ``-rA`` summary."""
    ids = list(known)
    out: dict[str, str] = {}
    for status, rest in _summary_lines(log):
        if status in ("FAILED", "ERROR"):
            tid, msg = split_message(rest, ids)
            out.setdefault(tid, msg)
    return out


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {"pytest": parse_pytest}


def parse_log(parser: str, log: str) -> dict[str, str]:
    try:
        return PARSERS[parser](log)
    except KeyError:
        raise ValueError(f"unknown log parser {parser!r}; known: {', '.join(PARSERS)}") from None


# --- JUnit XML -------------------------------------------------------------------------------------


_ILLEGAL_XML = re.compile("[^\u0009\u000a\u000d\u0020-\u007e\u0080-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_escape(s: str) -> str:
    """pytest's ``bin_xml_escape``: characters XML cannot hold become ``#xNN`` (the name it writes)."""
    return _ILLEGAL_XML.sub(lambda m: f"#x{ord(m.group()):02X}" if ord(m.group()) <= 0xFF
                            else f"#x{ord(m.group()):04X}", s)


def junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) pytest's JUnit XML gives the test ``nodeid`` (its ``mangle_test_address``)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), _xml_escape(names[-1])


@dataclass(frozen=True)
class JUnitCase:
    classname: str
    name: str
    file: str
    status: str
    message: str = ""

    def guess_id(self) -> str:
        """The node id, rebuilt from the file attribute when the caller did not ask for this test."""
        if self.file:
            module = re.sub(r"\.py$", "", self.file).replace("/", ".")
            if not self.classname:  # a collection error names the module only
                return self.file
            if self.classname == module or self.classname.startswith(module + "."):
                classes = [c for c in self.classname[len(module):].split(".") if c]
                return "::".join([self.file, *classes, self.name])
        return f"{self.classname.replace('.', '/')}.py::{self.name}" if self.classname else self.name


def _case_status(tc: ET.Element) -> tuple[str, str]:
    tags = {child.tag: child for child in tc}
    if "failure" in tags:
        return "FAILED", tags["failure"].get("message", "")
    if "error" in tags:
        return "ERROR", tags["error"].get("message", "")
    if "skipped" in tags:
        sk = tags["skipped"]
        if sk.get("type") == "pytest.xfail":
            return "XFAIL", sk.get("message", "")
        if sk.get("message") == _XPASS_STRICT:
            return "XPASS", _XPASS_STRICT
        return "SKIPPED", sk.get("message", "")
    return "PASSED", ""


def junit_cases(data: bytes) -> list[JUnitCase]:
    """Every ``testcase`` of a JUnit XML document, refused when it is not what pytest writes."""
    if len(data) > MAX_RESULT_BYTES:
        raise ResultFileError(f"the result file is {len(data)} bytes, over the {MAX_RESULT_BYTES} byte limit")
    head = data.lower()
    if b"<!doctype" in head or b"<!entity" in head:
        raise ResultFileError("the result file declares a DTD or entities; pytest never writes one")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        raise ResultFileError(f"the result file is not XML: {e}") from None
    return [JUnitCase(tc.get("classname", ""), tc.get("name", ""), tc.get("file", ""), *_case_status(tc))
            for tc in root.iter("testcase")]


def statuses_from_junit(cases: Iterable[JUnitCase], expected: Iterable[str] = ()) -> dict[str, str]:
    """Test id -> status: ``expected`` ids by their JUnit (classname, name); other tests by ``guess_id``."""
    index: dict[tuple[str, str], list[str]] = {}
    for tid in dict.fromkeys(expected):
        index.setdefault(junit_key(tid), []).append(tid)
    out: dict[str, str] = {}
    for case in cases:
        ids = index.get((case.classname, case.name))
        if ids and len(ids) > 1 and case.file:  # two ids with one key: the file tells them apart
            ids = [t for t in ids if t.split("::", 1)[0] == case.file] or ids
        for tid in ids or [case.guess_id()]:
            old = out.get(tid)
            out[tid] = case.status if old is None or _RANK[case.status] > _RANK[old] else old
    return out


def parse_junit(data: bytes, expected: Iterable[str] = ()) -> dict[str, str]:
    """Test id -> status from pytest's JUnit XML (see the module doc)."""
    return statuses_from_junit(junit_cases(data), expected)


def merge_text(statuses: dict[str, str], text: dict[str, str]) -> dict[str, str]:
    """The XML's statuses, with a PASSED the text summary calls XPASS made XPASS (text only makes worse)."""
    return {t: ("XPASS" if s == "PASSED" and text.get(t) == "XPASS" else s) for t, s in statuses.items()}
