"""The pinned libraries the shipped task set is built from (``libraries.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from envs.images import ImageRecipe

LIBRARIES_FILE = Path(__file__).with_name("libraries.json")
TEST_COMMAND = ("python3 -m pytest -p no:cacheprovider -o addopts= -rA --tb=short --color=no "
                "-W ignore::DeprecationWarning {tests}")


@dataclass(frozen=True)
class Library:
    """One pinned library: where its code comes from, its tests, and the files bugs go into."""

    name: str
    version: str
    license: str
    sha256: str
    pythonpath: str
    tests: tuple[str, ...]
    mutate: tuple[str, ...]
    wheelhouse: tuple[str, ...]

    @property
    def recipe(self) -> ImageRecipe:
        return ImageRecipe(repo=self.name, version=self.version, sha256=self.sha256, pythonpath=self.pythonpath,
                           requirements=self.wheelhouse)

    @property
    def image(self) -> str:
        return self.recipe.tag


def load_libraries(path: Path = LIBRARIES_FILE) -> list[Library]:
    data = json.loads(path.read_text())
    wheels = tuple(data.get("wheelhouse", []))
    return [Library(name=d["name"], version=d["version"], license=d["license"], sha256=d["sha256"],
                    pythonpath=d.get("pythonpath", "."), tests=tuple(d["tests"]), mutate=tuple(d["mutate"]),
                    wheelhouse=tuple(d.get("wheelhouse", wheels)))
            for d in data["libraries"]]


def library(name: str) -> Library:
    for lib in load_libraries():
        if lib.name == name:
            return lib
    raise KeyError(f"no library {name!r} in {LIBRARIES_FILE.name}")
