"""A rendered conversation is pieces: the control tokens the template inserts (``Control``) and text (``str``).

Text is text (issue 40): only a ``Control`` piece becomes a control id (``policy.chat.ChatEncoder``); a control
token's string inside text stays the characters it is. Standard library only, as ``policy.chat``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Control:
    """A control token that the template inserts (``token``: its string, e.g. ``<|im_end|>``)."""

    token: str


Piece = str | Control   # a rendered conversation: control tokens and text


def text_of(pieces: Iterable[Piece]) -> str:
    """The pieces as one string (control tokens spelled out): what people read, never what is tokenised."""
    return "".join(p.token if isinstance(p, Control) else p for p in pieces)
