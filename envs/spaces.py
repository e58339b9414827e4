"""The text spaces of the envs, and ``truncate``: the one way an env shortens text it shows the agent.

A space's ``fit(text)`` maps any text onto the space (cut in the middle past ``max_length``, and
for ``PrintableText`` unprintable characters replaced by ``?``), so an observation is always in its
space, whatever a command printed.
"""

from __future__ import annotations

import string
from typing import Any

from gymnasium import spaces

SAMPLE_CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"
MARKER_ROOM = 64  # room kept for the truncation marker
MAX_OBSERVATION = MAX_ACTION = 65_536  # the text spaces of the tool envs (SWE-v0, Tool-v0)


def truncate(text: str, limit: int) -> str:
    """``text`` cut in the middle past ``limit`` characters, with a marker saying how much went."""
    if len(text) <= limit:
        return text
    keep = max(limit - MARKER_ROOM, 0)
    head, tail = keep // 2, keep - keep // 2
    cut = len(text) - head - tail
    return text[:head] + f"\n[... {cut} characters truncated ...]\n" + (text[-tail:] if tail else "")


class TextSpace(spaces.Text):
    """A ``spaces.Text`` that can map any text onto itself."""

    def fit(self, text: str) -> str:
        """``text`` as an element of this space: cut in the middle to ``max_length``."""
        return truncate(text, self.max_length)


class UnicodeText(TextSpace):
    """Text of any Unicode characters up to ``max_length`` (samples use printable ASCII).

    Code and tool output are not ASCII; ``spaces.Text`` with a fixed charset would reject them.
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None) -> None:
        super().__init__(max_length=max_length, min_length=min_length, charset=SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"


class PrintableText(TextSpace):
    """Text of printable ASCII (``string.printable``) up to ``max_length``: what a terminal shows."""

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None) -> None:
        super().__init__(max_length=max_length, min_length=min_length, charset=string.printable, seed=seed)

    def fit(self, text: str) -> str:
        """``text`` with every character outside ``string.printable`` shown as ``?``, then cut to size."""
        return super().fit("".join(c if c in _PRINTABLE else "?" for c in text))


_PRINTABLE = frozenset(string.printable)
