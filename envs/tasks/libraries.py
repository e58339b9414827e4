"""Pinned libraries: what an image is built from (``libraries.json``, or your own file of the same shape).

A libraries file is ``{"wheelhouse": [...], "libraries": [{...}, ...]}`` (or just the list). An image
needs only a library's

- ``name``       distribution name on the package registry (its sdist must hold the library's tests)
- ``version``    the pinned version
- ``sha256``     of that sdist

and optionally ``pythonpath`` (the folder of /testbed that goes on ``sys.path``, ``"src"`` for src
layouts; default ``"."``), ``wheelhouse`` (pinned wheels installed in the image; default: the file's
top-level ``wheelhouse``, else the shipped file's, which holds pytest) and ``repo`` (the repository name
tasks give, e.g. ``"owner/name"``: the image is then named from it, ``agentenv/swe-owner__name:<version>``,
instead of ``agentenv/swe-<name>:<version>``). The mutation builder (``search``, ``build``) needs
``tests`` (test files or folders to run), ``mutate`` (the source files bugs go into) and ``license``
too; those are checked only when it runs (``Library.need``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.images import ImageRecipe
from envs.task import PYTEST_COMMAND, image_name

LIBRARIES_FILE = Path(__file__).with_name("libraries.json")
TEST_COMMAND = PYTEST_COMMAND
_SHA256 = re.compile(r"[0-9a-f]{64}")
_WHAT_FOR = {"tests": "the test files or folders the builder runs",
             "mutate": "the source files bugs are injected into",
             "license": "the library's license, recorded in each task"}


class LibraryError(ValueError):
    """A libraries file or one of its entries is invalid; the message names the file, the library and the field."""

    def __init__(self, message: str, *, where: str | None = None, library: str | None = None,
                 field: str | None = None) -> None:
        self.where, self.library, self.field = where, library, field
        parts = [p for p in (where, f"library {library!r}" if library else None, f"field {field!r}" if field else None)
                 if p]
        super().__init__(f"{': '.join(parts)}: {message}" if parts else message)


@dataclass(frozen=True)
class Library:
    """One pinned library: where its code comes from, and (for the mutation builder) its tests and bug sites."""

    name: str
    version: str
    sha256: str
    pythonpath: str = "."
    wheelhouse: tuple[str, ...] = ()
    repo: str = ""                  # the repository name tasks use; "" -> pypi/<name>
    license: str = ""               # the rest: needed by the mutation builder only
    tests: tuple[str, ...] = ()
    mutate: tuple[str, ...] = ()
    source: str = ""                # the file it was read from (for messages)

    @property
    def recipe(self) -> ImageRecipe:
        return ImageRecipe(repo=self.name, version=self.version, sha256=self.sha256, pythonpath=self.pythonpath,
                           requirements=self.wheelhouse,
                           image=image_name(self.repo, self.version) if self.repo else "")

    @property
    def image(self) -> str:
        return self.recipe.tag

    def need(self, *names: str, for_what: str = "the mutation builder") -> Library:
        """This library, or a LibraryError naming the first of ``names`` it lacks (fields only ``for_what`` needs)."""
        for n in names:
            if not getattr(self, n):
                raise LibraryError(f"required by {for_what} ({_WHAT_FOR.get(n, n)}); an image needs only "
                                   "name, version and sha256", where=self.source or None, library=self.name, field=n)
        return self


def _entry(d: Any, default_wheels: tuple[str, ...], where: str) -> Library:
    if not isinstance(d, Mapping):
        raise LibraryError(f"a library is a JSON object, got {type(d).__name__}", where=where)
    name = d.get("name")
    if not isinstance(name, str) or not name.strip():
        raise LibraryError(f"required, a non-empty string (the distribution name); got {name!r}", where=where,
                           field="name")

    def err(f: str, msg: str) -> LibraryError:
        return LibraryError(msg, where=where, library=name, field=f)

    out: dict[str, Any] = {"name": name, "source": where}
    for f in ("version", "sha256"):
        v = d.get(f)
        if not isinstance(v, str) or not v.strip():
            raise err(f, f"required, a non-empty string; got {v!r}")
        out[f] = v.strip()
    if not _SHA256.fullmatch(out["sha256"]):
        raise err("sha256", f"must be the sdist's sha256 (64 lowercase hex digits), got {out['sha256']!r}")
    for f, default in (("pythonpath", "."), ("repo", ""), ("license", "")):
        v = d.get(f, default)
        if not isinstance(v, str):
            raise err(f, f"must be a string, got {type(v).__name__}")
        out[f] = v
    if out["pythonpath"].startswith("/") or ".." in out["pythonpath"].split("/"):
        raise err("pythonpath", f"must be a folder inside the source tree, got {out['pythonpath']!r}")
    for f in ("tests", "mutate", "wheelhouse"):
        v = d.get(f, list(default_wheels) if f == "wheelhouse" else [])
        if isinstance(v, str) or not isinstance(v, list | tuple) or not all(isinstance(x, str) and x for x in v):
            raise err(f, f"must be a list of non-empty strings, got {v!r}"[:300])
        out[f] = tuple(v)
    return Library(**out)


def _shipped_wheelhouse() -> tuple[str, ...]:
    return tuple(json.loads(LIBRARIES_FILE.read_text()).get("wheelhouse", []))


def load_libraries(path: str | Path = LIBRARIES_FILE) -> list[Library]:
    """Every library in a libraries file, checked (errors name the file, the library and the field)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise LibraryError(f"cannot read the libraries file: {e}", where=str(p)) from None
    except ValueError as e:
        raise LibraryError(f"not valid JSON: {e}", where=str(p)) from None
    if isinstance(data, list):
        data = {"libraries": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("libraries"), list):
        raise LibraryError('a libraries file is {"libraries": [...]} (or a list of libraries)', where=str(p))
    wheels = data.get("wheelhouse")
    if wheels is None:
        wheels = _shipped_wheelhouse()
    if isinstance(wheels, str) or not isinstance(wheels, list | tuple) or not all(
            isinstance(x, str) and x for x in wheels):
        raise LibraryError(f"the top-level 'wheelhouse' must be a list of pinned requirements, got {wheels!r}",
                           where=str(p), field="wheelhouse")
    libs = [_entry(d, tuple(wheels), f"{p}[{i}]") for i, d in enumerate(data["libraries"])]
    seen: set[str] = set()
    for lib in libs:
        if lib.image in seen:
            raise LibraryError(f"two libraries build the same image {lib.image}", where=lib.source,
                               library=lib.name, field="version")
        seen.add(lib.image)
    return libs


def library(name: str, path: str | Path = LIBRARIES_FILE) -> Library:
    for lib in load_libraries(path):
        if lib.name == name:
            return lib
    raise KeyError(f"no library {name!r} in {Path(path).name}")
