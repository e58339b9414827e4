"""Typed TOML over dataclasses: layers merged with their types checked, rendered back with each key's documentation.

A configuration is a dataclass of section dataclasses whose fields carry their documentation (``doc``). ``merge``
lays a TOML table over one, refusing unknown keys and values of the wrong type by name (a typo never falls back to
a default); ``render`` writes one back as TOML with each key's documentation as a comment. ``trainer.loop.config``
holds the sections of ``agentenv train``; this module knows nothing of them.
"""

from __future__ import annotations

import json
import tomllib
import typing
from dataclasses import MISSING, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot be used: an unknown key, a wrong type, a value out of range."""


def doc(default: Any, text: str) -> Any:
    """A dataclass field with its default and its documentation (kept in ``metadata["doc"]``)."""
    if isinstance(default, dict | list):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


# --- reading ----------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp`` (int -> float allowed; nothing else is converted)."""
    origin = typing.get_origin(tp)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float or tp is str:
        if isinstance(value, tp):
            return value
    elif origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, list):
            return [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    else:
        return value
    raise ConfigError(f"{where}: expected {_type_name(origin or tp)}, got {type(value).__name__} {value!r}")


def merge(obj: Any, data: dict[str, Any], where: str) -> Any:
    """``obj`` (a config dataclass) with ``data``'s keys set; unknown keys raise ConfigError naming them."""
    hints = typing.get_type_hints(type(obj))
    known = {f.name: f for f in fields(obj)}
    changes: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in known:
            section = f"[{where}]" if where else "the top level"
            raise ConfigError(f"unknown key {path!r} in {section}; known: {', '.join(sorted(known))}")
        current = getattr(obj, key)
        if is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} is a section ([{path}]), not a value")
            changes[key] = merge(current, value, path)
        else:
            changes[key] = coerce(value, hints[key], path)
    return replace(obj, **changes)


def parse_override(item: str) -> dict[str, Any]:
    """``section.key=value`` (value in TOML syntax; a bare word is a string) -> a nested dict."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set takes section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    out: dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


# --- rendering --------------------------------------------------------------------------------------------


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def render(cfg: Any, default: Any, comments: bool = True) -> str:
    """``cfg`` (a dataclass of sections) as TOML, each key with its documentation (and its value in ``default``,
    where it differs) as a comment."""
    lines: list[str] = []

    def emit(obj: Any, dflt: Any) -> None:
        for f in fields(obj):
            v = getattr(obj, f.name)
            if is_dataclass(v):
                continue
            text = f"{f.name} = {toml_value(v)}"
            if comments:
                note = f.metadata.get("doc", "")
                d = getattr(dflt, f.name)
                if d != v:
                    note += f" [default: {toml_value(d)}]"
                text = f"{text:<44} # {note}"
            lines.append(text)

    emit(cfg, default)
    for f in fields(cfg):
        sub = getattr(cfg, f.name)
        if is_dataclass(sub):
            lines.append("")
            lines.append(f"[{f.name}]" + (f"  # {type(sub).__doc__}" if comments and type(sub).__doc__ else ""))
            emit(sub, getattr(default, f.name))
    return "\n".join(lines) + "\n"


def to_dict(cfg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if is_dataclass(v) else v
    return out


def undocumented(cls: Any) -> list[str]:
    """The keys of dataclass ``cls`` (sections walked) without documentation or a default."""
    missing = []

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if isinstance(hints[f.name], type) and is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            elif not f.metadata.get("doc") or (f.default is MISSING and f.default_factory is MISSING):
                missing.append(prefix + f.name)

    walk(cls, "")
    return missing
