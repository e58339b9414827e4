"""``agentenv.terminal``: what the CLIs print of a sandbox, a trajectory or a log reaches the terminal as visible text
(issue 40, finding 7): every control but newline and tab written as its escape, rich markup escaped, log records
cleaned in the process (their message, arguments and traceback)."""

from __future__ import annotations

import io
import logging
import re

import pytest
from rich.console import Console

from agentenv import terminal

CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


@pytest.mark.parametrize(("raw", "shown"), [
    ("\x1b[2J", "\\x1b[2J"),                              # CSI: clear the screen
    ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),           # OSC: the window title, BEL-terminated
    ("\x1b]8;;http://x\x1b\\link", "\\x1b]8;;http://x\\x1b\\link"),   # OSC 8 hyperlink, ST-terminated
    ("\x9b2J\x9d0;t\x9c", "\\x9b2J\\x9d0;t\\x9c"),        # 8-bit CSI, OSC and ST
    ("FAILED\rPASSED", "FAILED\\x0dPASSED"),               # a carriage return overwriting the line
    ("a\r\nb\tc\n", "a\nb\tc\n"),                          # CR LF is a newline; tab and newline stay
    ("x\x08\x7f\x00", "x\\x08\\x7f\\x00"),
    ("abc\u202edef", "abc\\u202edef"),                     # a bidirectional override
    ("[reverse]plain [/] é日", "[reverse]plain [/] é日"),   # printable text is left alone
])
def test_clean_writes_each_control_as_its_visible_escape(raw, shown):
    assert terminal.clean(raw) == shown
    assert CONTROLS.search(terminal.clean(raw)) is None


def test_markup_and_plain_print_exactly_the_cleaned_text():
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    text = "[reverse]label[/reverse] \x1b[1A[bold]x\\"
    console.print(f"[bold]{terminal.markup(text)}[/]", terminal.plain(text), highlight=False)
    assert out.getvalue() == f"{terminal.clean(text)} {terminal.clean(text)}\n"


@pytest.fixture
def guarded():
    """``guard_logs`` for one test: the process's record factory as it was afterwards."""
    before = logging.getLogRecordFactory()
    terminal.guard_logs()
    yield
    logging.setLogRecordFactory(before)


def test_guarded_logs_carry_no_control(guarded, caplog):
    terminal.guard_logs()   # again: nothing more
    log = logging.getLogger("agentenv.test")
    with caplog.at_level(logging.INFO, logger="agentenv.test"):
        log.info("sandbox %s said %r (%d)", "sb-\x1b]0;t\x07", "\x9b2J", 3)
        log.info("%(label)s", {"label": "\x1b[2J"})
        try:
            raise RuntimeError("build step failed: \x1b[2K\rall tests PASSED")
        except RuntimeError:
            log.exception("template build \x1b[31m")
    text = "\n".join(caplog.text.splitlines())
    assert CONTROLS.search(caplog.text.replace("\n", "")) is None, text
    assert "sandbox sb-\\x1b]0;t\\x07 said '\\\\x9b2J' (3)" in text and "\\x1b[2J" in text
    assert "RuntimeError: build step failed: \\x1b[2K\\x0dall tests PASSED" in text
