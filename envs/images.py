"""Environment images, offline: one image per repository and version, built ``FROM agentenv/base``.

The host fetches what an image needs from the package registry with pip (sandboxes have no
network): the repository's source distribution (checked against a pinned sha256) and a wheelhouse
of its dependencies. The Dockerfile installs the wheelhouse with ``pip --no-index``, puts the
source at ``/testbed`` as a git repository with one commit (fixed author and dates, so its hash is
the same on every machine), and makes it importable through a ``.pth`` file (what an editable
install does, without needing the build backend offline).

Builds are cached by a hash of their inputs (the recipe, the Dockerfile and the base image id),
kept as the image label ``agentenv.inputs``: a rebuild with nothing changed is one inspect call.
Downloads are cached under ``$AGENTENV_CACHE`` (default ``/var/cache/agentenv/swe``).

An image is named ``agentenv/swe-<name>:<version>`` (``envs.task.image_name``), the name a task record
without an ``image`` field gets, unless its recipe names it (``image``); ``tags`` gives it more names
(``docker tag``: one image per repository and version, one name per task instance that runs in it).

Two layouts (``layout``): ``agentenv`` (the interpreter of the base image, the dependencies installed into it) and
``swebench`` (SWE-bench's: a ``testbed`` environment at /opt/miniconda3 beside the repository at /testbed, with a
stand-in for conda; ``envs.swebench_layout``). A recipe may add files to the source (``overlay``: a program the
sdist leaves out, e.g. SymPy's ``bin/test``), which are then part of what the image's commit holds.

``image_head(tag)`` is the commit its /testbed is at: what a task's ``base_commit`` must be (or ``"HEAD"``),
printed after each build and by ``agentenv tasks base-commit IMAGE``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentenv.errors import AgentEnvError
from agentenv.host import archives
from agentenv.host.images import BuildFailed, build, docker_client
from envs import swebench_layout
from envs.task import image_name

DOCS = "README.md, 'Bring your own tasks'"
BASE_IMAGE = "agentenv/base"
LABEL = "agentenv.inputs"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "agentenv", "GIT_AUTHOR_EMAIL": "agentenv@localhost",
    "GIT_COMMITTER_NAME": "agentenv", "GIT_COMMITTER_EMAIL": "agentenv@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
# Files git never tracks in /testbed (byte code, caches, build metadata), so `git diff` shows only edits.
GIT_EXCLUDES = ["__pycache__/", "*.pyc", ".pytest_cache/", "*.egg-info/", ".eggs/", "build/"]

DOCKERFILE = """\
FROM {base}
ENV {env} PYTHONDONTWRITEBYTECODE=1
COPY wheels /tmp/wheels
RUN {install} rm -rf /tmp/wheels /root/.cache
RUN printf '{excludes}' > /etc/gitignore \\
 && git config --system core.excludesFile /etc/gitignore \\
 && git config --system init.defaultBranch main \\
 && git config --system advice.detachedHead false \\
 && git config --system safe.directory '*'
COPY src /testbed
WORKDIR /testbed
RUN echo /testbed/{pythonpath} > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/testbed.pth" \\
 && git init -q && git add -A && git commit -q -m '{repo} {version}'
"""


LAYOUTS = {"agentenv": DOCKERFILE, "swebench": swebench_layout.DOCKERFILE}


class ImageBuildError(AgentEnvError):
    """An environment image could not be built (download, checksum or docker build failed)."""


class ImageMissing(AgentEnvError, LookupError):
    """An environment image is not on this host; the message says how to build it."""

    def __init__(self, image: str) -> None:
        self.image = image
        super().__init__(f"image {image} is not on this host", fix=build_hint(image))


def build_hint(image: str, libraries: str = "LIBRARIES.json") -> str:
    """What to run (or write) to get ``image``: the images command with a libraries file, or your own build."""
    m = re.fullmatch(r"agentenv/swe-([a-z0-9._-]+?)(?:__([a-z0-9._-]+))?:(.+)", image)
    if m:
        owner, name, version = (m.group(1), m.group(2), m.group(3)) if m.group(2) else (None, m.group(1), m.group(3))
        entry = (f'{{"name": "<distribution>", "version": "{version}", "sha256": "<sdist sha256>", '
                 f'"repo": "{owner}/{name}"}}' if owner else
                 f'{{"name": "{name}", "version": "{version}", "sha256": "<sdist sha256>"}}')
        return (f"build it with `agentenv tasks images --libraries {libraries}`, the file listing {entry}; "
                f"or build your own image of the repository at /testbed and tag it {image} (see {DOCS})")
    return f"build or pull {image} on the sandbox host (see {DOCS})"


@dataclass(frozen=True)
class ImageRecipe:
    """What one repository+version image is made of."""

    repo: str                       # distribution name on the registry, e.g. "toolz"
    version: str                    # pinned version
    sha256: str                     # of the source distribution
    pythonpath: str = "."           # folder of /testbed that goes on sys.path ("src" for src layouts)
    requirements: tuple[str, ...] = field(default_factory=tuple)  # pinned wheels for the wheelhouse
    base: str = BASE_IMAGE
    image: str = ""                 # the tag; "" -> agentenv/swe-<repo>:<version>
    layout: str = "agentenv"        # or "swebench" (envs.swebench_layout)
    overlay: Mapping[str, str] = field(default_factory=dict)            # path -> text of a file added to the source
    tags: tuple[str, ...] = ()      # more names for the built image (not an input: re-tagging is cheap)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown image layout {self.layout!r}; known: {', '.join(LAYOUTS)}")

    @property
    def tag(self) -> str:
        return self.image or image_name(f"pypi/{self.repo}", self.version)

    @property
    def dockerfile(self) -> str:
        return LAYOUTS[self.layout]

    def inputs_hash(self, base_id: str) -> str:
        defaults = {"image": "", "layout": "agentenv", "overlay": {}}
        # a field at its default is left out: a recipe that does not use it keeps the hash it always had
        recipe = {k: v for k, v in asdict(self).items() if k != "tags" and v != defaults.get(k, object())}
        extra = {"layout": swebench_layout.context_files()} if self.layout == "swebench" else {}
        blob = json.dumps({"recipe": recipe, "dockerfile": self.dockerfile, "base": base_id,
                           "git": GIT_ENV, "excludes": GIT_EXCLUDES, **extra}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    d = Path(os.environ.get("AGENTENV_CACHE", "/var/cache/agentenv/swe"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip(args: Sequence[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise ImageBuildError(f"pip could not download {what}: {r.stderr.strip()[-800:]}",
                              fix="check that the host reaches the package registry (pip config, proxy)")


def fetch_sdist(repo: str, version: str, sha256: str) -> Path:
    """The source distribution from the registry (cached), checked against its pinned sha256."""
    folder = cache_dir() / "sdists" / sha256
    found = [p for p in folder.glob("*.tar.gz")] if folder.exists() else []
    if not found or _sha256(found[0]) != sha256:
        shutil.rmtree(folder, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
        try:
            _pip(["--no-deps", "--no-binary", ":all:", "-d", str(tmp), f"{repo}=={version}"], f"{repo}=={version}")
            found = list(tmp.glob("*.tar.gz"))
            if len(found) != 1:
                raise ImageBuildError(f"expected one .tar.gz sdist for {repo}=={version}, got {[p.name for p in found]}")
            got = _sha256(found[0])
            if got != sha256:
                raise ImageBuildError(f"{found[0].name}: sha256 {got} differs from the pinned {sha256}",
                                      fix="the registry served another file: re-pin only after checking it")
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        found = list(folder.glob("*.tar.gz"))
    return found[0]


def extract_sdist(archive: Path, dest: Path) -> Path:
    """Unpack an sdist's single top folder into ``dest`` (created); returns ``dest``."""
    with tarfile.open(archive) as tar:
        try:
            members = archives.checked(tar)  # our own rules: Debian 12's Python has no extraction filters
        except archives.UnsafeArchive as e:
            raise ImageBuildError(f"{archive.name}: {e}") from None
        tops = {m.name.split("/", 1)[0] for m in members}
        if len(tops) != 1:
            raise ImageBuildError(f"{archive.name}: expected one top folder, got {sorted(tops)[:5]}")
        tmp = dest.parent / (dest.name + ".unpack")
        shutil.rmtree(tmp, ignore_errors=True)
        archives.extract(tar, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    (tmp / tops.pop()).rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    for link in [p for p in dest.rglob("*") if p.is_symlink() and not p.exists()]:
        link.unlink()  # dangling links (e.g. docs pointing at files the sdist left out) break COPY
    return dest


def fetch_wheels(requirements: Sequence[str]) -> Path:
    """A wheelhouse with ``requirements`` and their dependencies (cached by the requirement list)."""
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:16]
    folder = cache_dir() / "wheels" / key
    if (folder / ".complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if requirements:
        _pip(["--only-binary", ":all:", "-d", str(folder), *requirements], ", ".join(requirements))
    (folder / ".complete").write_text("\n".join(requirements))
    return folder


def image_exists(tag: str) -> bool:
    """The image is on this host's Docker engine."""
    import docker.errors

    try:
        docker_client().api.inspect_image(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def image_head(tag: str) -> str:
    """The commit /testbed is at in a fresh sandbox of image ``tag`` (what ``base_commit: "HEAD"`` means)."""
    import agentenv

    if not image_exists(tag):
        raise ImageMissing(tag)
    with agentenv.Sandbox.create(tag, cpus=1.0, memory="512m", network=False) as sb:
        r = sb.exec("git rev-parse --verify HEAD", timeout=60, cwd="/testbed")
    head = r.stdout.strip()
    if r.exit_code != 0 or not re.fullmatch(r"[0-9a-f]{40}", head):
        raise AgentEnvError(f"image {tag}: /testbed is not a git repository with a commit "
                            f"({(r.stdout + r.stderr).strip()[-300:]})",
                            fix="a task image holds its repository at /testbed, committed (see envs/images.py)")
    return head


def image_inputs(tag: str) -> str | None:
    """The ``agentenv.inputs`` label of a local image, or None when it is absent."""
    import docker.errors

    try:
        attrs = docker_client().api.inspect_image(tag)
    except docker.errors.ImageNotFound:
        return None
    return ((attrs.get("Config") or {}).get("Labels") or {}).get(LABEL)


def build_image(recipe: ImageRecipe, *, force: bool = False, log: Callable[[str], None] | None = None) -> str:
    """Build (or find, when its inputs are unchanged) the image of ``recipe``, and give it its ``tags``; returns its
    tag.

    With ``log``, progress goes there, and so does the image's base commit (one sandbox start to read it).
    """
    import docker.errors

    say = log or (lambda _m: None)
    client = docker_client()
    try:
        base_id = client.api.inspect_image(recipe.base)["Id"]
    except docker.errors.ImageNotFound:
        raise ImageBuildError(f"base image {recipe.base!r} is missing", fix="run scripts/bootstrap.sh") from None
    digest = recipe.inputs_hash(base_id)
    if not force and image_inputs(recipe.tag) == digest:
        _tag(recipe)
        if log is not None:
            log(f"[image] {recipe.tag} is up to date ({digest}), base commit {image_head(recipe.tag)}")
        return recipe.tag
    say(f"[image] building {recipe.tag} ({digest})")
    sdist = fetch_sdist(recipe.repo, recipe.version, recipe.sha256)
    wheels = fetch_wheels(recipe.requirements)
    with tempfile.TemporaryDirectory(prefix="agentenv-image-", dir=cache_dir()) as tmp:
        ctx = Path(tmp)
        shape_source(extract_sdist(sdist, ctx / "src"), recipe)
        shutil.copytree(wheels, ctx / "wheels")
        reqs = " ".join(_shell_word(r) for r in recipe.requirements)
        if recipe.layout == "swebench":
            install = swebench_layout.install_command(reqs)
            for rel, (text, mode) in swebench_layout.context_files().items():
                (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
                (ctx / rel).write_text(text)
                (ctx / rel).chmod(mode)
        else:
            install = (f"python3 -m pip install --no-index --find-links /tmp/wheels --break-system-packages "
                       f"--no-warn-script-location -q {reqs} &&" if recipe.requirements else "")
        (ctx / "Dockerfile").write_text(recipe.dockerfile.format(
            base=recipe.base, env=" ".join(f'{k}="{v}"' for k, v in GIT_ENV.items()), install=install,
            excludes="\\n".join(GIT_EXCLUDES) + "\\n", pythonpath=recipe.pythonpath,
            repo=recipe.repo, version=recipe.version))
        labels = {LABEL: digest, "agentenv.repo": recipe.repo, "agentenv.version": recipe.version}
        try:
            build(str(ctx), recipe.tag, labels=labels)
        except BuildFailed as e:
            raise ImageBuildError(f"docker build of {recipe.tag} failed: {e.error}\n" + "\n".join(e.output[-20:])) from e
    if image_inputs(recipe.tag) != digest:
        raise ImageBuildError(f"docker build of {recipe.tag} finished but the image is not there")
    _tag(recipe)
    if log is not None:  # one more sandbox start (~0.3 s): only when someone reads it
        log(f"[image] built {recipe.tag} base commit {image_head(recipe.tag)}")
    return recipe.tag


def shape_source(src: Path, recipe: ImageRecipe) -> Path:
    """The unpacked sdist at ``src`` with the recipe's files added (``overlay``; a file starting ``#!`` executable)."""
    for rel, text in recipe.overlay.items():
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts:
            raise ImageBuildError(f"overlay path {rel!r} is not a relative path inside the source", fix="fix the recipe")
        dest = src.joinpath(*parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        dest.chmod(0o755 if text.startswith("#!") else 0o644)
    return src


def _tag(recipe: ImageRecipe) -> None:
    """Give the built image its other names (``docker tag``; an existing name is moved to it)."""
    api = docker_client().api
    for name in recipe.tags:
        repository, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
        api.tag(recipe.tag, repository, tag or "latest", force=True)


def _shell_word(s: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_.=<>!~,\[\]-]+", s) and not any(c in s for c in "<>"):
        return s
    return "'" + s.replace("'", "'\"'\"'") + "'"
