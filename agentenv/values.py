"""How the value types of ``agentenv.api`` travel: their fields as a dict of plain values, and back.

``api.py`` names the contract (each value type with its fields and checks, the Protocols); this is the machinery
under every value type alike (lists for tuple fields included), apart so that the contract reads as the list of names a caller uses. The server
sends a value as ``to_wire()`` and the client rebuilds it with ``from_wire``; keys a newer side adds are ignored,
so a new field is one edit in ``api.py``. Standard library only, like ``api.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

_V = TypeVar("_V")


class Value:
    """Wire helpers shared by the value types: a dict of the fields, and back (unknown keys ignored)."""

    _nested: ClassVar[dict[str, type[Value]]] = {}  # fields that are value types themselves

    def __post_init__(self) -> None:
        """A list given for a field declared a tuple (from the wire, or from a caller) is kept as that tuple."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, list) and str(f.type).startswith("tuple"):
                object.__setattr__(self, f.name, tuple(value))

    def to_wire(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls: type[_V], data: dict[str, Any]) -> _V:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kwargs = {k: v for k, v in data.items() if k in names}
        for name, sub in cls._nested.items():  # type: ignore[attr-defined]
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = sub.from_wire(kwargs[name])
        return cls(**kwargs)


def _plain(v: Any) -> Any:
    if isinstance(v, Value):
        return v.to_wire()
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, tuple):
        return list(v)
    return v


def info_of(obj: Any, cls: type[_V]) -> _V:
    """The ``cls`` value of any object that has its fields as attributes (a Sandbox, a Snapshot, ...)."""
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
