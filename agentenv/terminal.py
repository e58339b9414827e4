"""Text from a sandbox, a trajectory, a label or a log, made safe to print on a terminal (issue 40, finding 7).

Such text is an adversary's: raw escape sequences in it would clear the screen, set the window title (OSC), move the
cursor to overwrite what was printed with "all tests PASSED", and through rich it would become markup (a
``[reverse]`` label). ``clean`` writes every control character as its visible escape instead: the C0 controls but
newline and tab, DEL, the C1 controls (U+0080-U+009F, where a terminal may read an 8-bit CSI or OSC) and the
bidirectional overrides that reorder a line (U+202A-U+202E, U+2066-U+2069, U+200E/F, U+061C), as ``\\x1b``,
``\\x9b``, ``\\u202e``. Every other character of an escape sequence is printable, so with its introducer visible no
sequence in any form (CSI, OSC, DCS, 7- or 8-bit) reaches the terminal, and what it was stays readable for
debugging. A CR LF pair is a newline; a lone CR is made visible (it would let a line overwrite itself).

Everything the CLIs print from a sandbox, a trajectory or a log goes through here: ``markup`` (``clean`` and rich's
markup escaping) for text spliced into a rich markup string, ``plain`` (a rich ``Text``) for table cells, and
``guard_logs`` for the process's log records (message, arguments, traceback), so a server's log lines carry no
escape either.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Mapping
from typing import Any

from rich.markup import escape
from rich.text import Text

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(text: str) -> str:
    """``text`` with every terminal control written as its visible escape (newline and tab kept)."""
    return _UNSAFE.sub(_visible, text.replace("\r\n", "\n"))


def markup(text: object) -> str:
    """``text`` cleaned and escaped for a rich markup string: printed exactly as it reads, never as styles."""
    return escape(clean(str(text)))


def plain(text: object) -> Text:
    """``text`` cleaned, as a rich ``Text`` (a table cell rich prints as is, never as markup)."""
    return Text(clean(str(text)))


def _arg(value: object) -> object:
    """A log argument as is, unless its text holds a control (then that text, cleaned)."""
    if isinstance(value, int | float):
        return value
    text = value if isinstance(value, str) else str(value)
    return clean(text) if _UNSAFE.search(text) or "\r" in text else value


def _clean_record(record: logging.LogRecord) -> logging.LogRecord:
    if isinstance(record.msg, str):
        record.msg = clean(record.msg)
    if isinstance(record.args, Mapping):
        record.args = {k: _arg(v) for k, v in record.args.items()}
    elif isinstance(record.args, tuple):   # kept a tuple: uvicorn's access formatter unpacks it
        record.args = tuple(_arg(a) for a in record.args)
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        record.exc_text = clean("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
    if record.stack_info:
        record.stack_info = clean(record.stack_info)
    return record


def guard_logs() -> None:
    """Clean every log record this process makes from now on (its message, arguments and traceback; again: nothing)."""
    made = logging.getLogRecordFactory()
    if getattr(made, "agentenv_clean", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return _clean_record(made(*args, **kwargs))

    factory.agentenv_clean = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
