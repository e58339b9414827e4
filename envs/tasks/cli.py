"""``agentenv tasks images | base-commit | scrub-script | search | build | fixes | validate | prewarm``: the SWE task
sets' commands, typer commands like the rest of ``agentenv`` (its help style, its option spellings: a token from
``--token-file`` or ``$AGENTENV_TOKEN``), added to it through the ``agentenv.commands`` entry point.

The shipped set by default; any other with ``--libraries FILE`` (the libraries images are built from, see
envs/tasks/libraries.py) and ``--tasks FILE`` (task records, see envs/task.py: JSONL, JSON or Parquet, a published
dataset's records as they are; ``--dataset NAME`` when their fields cannot tell which, see envs/datasets).
``prewarm`` gets a task set's images onto every env server of a fleet before a run. An error of the task set, its
libraries or a server is said in one line (exit code 2), not as a traceback.

``agentenv --help`` lists this group by the ``help=`` of ``app`` below, read from this file without importing it
(``agentenv.cli.plugins``); the work each command does is imported when it runs. ``python -m envs.tasks`` runs the
same app (``envs.tasks.__main__``), for a release, saying it is deprecated.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, ParamSpec, TextIO, TypeVar

import typer

from agentenv.cli.shared import TokenFile, read_token
from agentenv.terminal import clean
from envs.datasets import DATASETS
from envs.task import SHIPPED, TaskError, load_tasks
from envs.tasks.libraries import LIBRARIES_FILE, Library, LibraryError, load_libraries

app = typer.Typer(help="SWE task sets: build their images, validate them, prewarm a fleet (agentenv tasks --help).",
                  no_args_is_help=True)
P = ParamSpec("P")
R = TypeVar("R")

Libraries = Annotated[Path, typer.Option(metavar="FILE", show_default=False,
                                         help="libraries file (default: the shipped envs/tasks/libraries.json)")]
Only = Annotated[list[str] | None, typer.Option("--library", metavar="NAME",
                                                   help="only these libraries (repeatable)")]
Mutations = Annotated[Path | None, typer.Option(metavar="FILE", help="pinned mutations (default: the shipped file; "
                                                                     "required with --libraries)")]


def _dataset(name: str | None) -> str | None:
    if name is not None and name not in DATASETS:
        raise typer.BadParameter(f"{name!r} is not one of {', '.join(DATASETS)}")
    return name


Dataset = Annotated[str | None, typer.Option(callback=_dataset, help="the dataset the records come from: "
                                             f"{' | '.join(DATASETS)} (default: detected)")]
Seed = Annotated[int, typer.Option(help="seed of the random choices")]


def say(text: str, file: TextIO | None = None) -> None:
    """Print a line whose text may come from a sandbox, a build or a test run, its escapes made visible."""
    print(clean(text), file=file or sys.stdout)


def _said(fn: Callable[P, R]) -> Callable[P, R]:
    """The command ``fn``, whose errors of the task set, its libraries or a server are said in one line (exit 2)."""
    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        from agentenv.errors import AgentEnvError

        try:
            return fn(*args, **kwargs)
        except (LibraryError, TaskError, AgentEnvError) as e:  # what to fix, not a traceback
            say(f"error: {e}", file=sys.stderr)
            raise typer.Exit(2) from None
    return run


def _exit(rc: int) -> None:
    if rc:
        raise typer.Exit(rc)


def _libraries(path: Path, only: list[str] | None) -> tuple[list[Library], list[Library]]:
    """Every library of the file ``path``, and those of them ``only`` names (all without it); LibraryError for a name
    the file lacks."""
    every = load_libraries(path)
    libs = [lib for lib in every if not only or lib.name in only]
    if only and len(libs) < len(set(only)):
        missing = sorted(set(only) - {lib.name for lib in libs})
        raise LibraryError(f"no library {', '.join(missing)} in it", where=str(path))
    return every, libs


@app.command()
@_said
def images(libraries: Libraries = LIBRARIES_FILE, library: Only = None,
           tasks: Annotated[Path | None, typer.Option(metavar="FILE", help="only the images these tasks need")] = None,
           force: Annotated[bool, typer.Option(help="build even where an image is up to date")] = False) -> None:
    """Build (or find up to date) one image per library; prints its base commit."""
    from envs.images import build_image
    from envs.tasks import build

    every, libs = _libraries(libraries, library)
    rc = 0
    if tasks:
        chosen = load_tasks(tasks)
        made = {lib.image for lib in every}
        others = [t for t in chosen if t.image not in made]  # images no library makes: must be here
        for why in build.prepare_images(others, [], build=False, libraries_file=str(libraries)).values():
            say(f"[image] {why}")
            rc = 1
        libs = [lib for lib in libs if lib.image in {t.image for t in chosen}]
    for lib in libs:
        build_image(lib.recipe, force=force, log=say)
    _exit(rc)


@app.command("base-commit")
@_said
def base_commit(image: Annotated[list[str], typer.Argument(help="images built for tasks")]) -> None:
    """The commit an image's /testbed is at (a task's base_commit)."""
    from envs.images import image_head

    for name in image:
        say(f"{name} {image_head(name)}")


@app.command("scrub-script")
def scrub_script() -> None:
    """The sh script a reset runs in /testbed to drop git history past HEAD.

    Run it in an image built from a real history (RUN cd /testbed && git checkout -f BASE && sh scrub.sh) so resets
    need not repack or count objects."""
    from envs.task_sandbox import SCRUB

    print(SCRUB, end="")


def _mutations(libraries: Path, mutations: Path | None, out: Path | None, command: str) -> Path:
    """The mutations file a search pins to or a build reads; LibraryError where another libraries file than the
    shipped one is given without the files to write (the shipped ones are never overwritten by another set)."""
    from envs.tasks import build

    if libraries != LIBRARIES_FILE and (mutations is None or (command == "build" and out is None)):
        need = "--mutations FILE" + (" and --out FILE" if command == "build" else "")
        raise LibraryError(f"with --libraries, give {need} (the shipped files are not overwritten)",
                           where=str(libraries))
    return mutations or build.MUTATIONS_FILE


@app.command()
@_said
def search(libraries: Libraries = LIBRARIES_FILE, library: Only = None, mutations: Mutations = None,
           keep: Annotated[int, typer.Option(help="mutations to keep per library")] = 9,
           max_tries: Annotated[int, typer.Option(help="test runs per library at most")] = 80,
           seed: Seed = 0) -> None:
    """Find mutations the libraries' tests catch; pin them in a mutations file."""
    from envs.images import build_image
    from envs.tasks import build

    _, libs = _libraries(libraries, library)
    pinned = _mutations(libraries, mutations, None, "search")
    found = build.read_mutations(pinned) if pinned.exists() else {}
    for lib in libs:
        lib.need("tests", "mutate", for_what="search")
        build_image(lib.recipe, log=say)
        found[lib.name] = build.search(lib, keep=keep, max_tries=max_tries, seed=seed, log=say)
        build.write_mutations(found, seed, pinned)


@app.command("build")
@_said
def build_tasks(libraries: Libraries = LIBRARIES_FILE, library: Only = None, mutations: Mutations = None,
                out: Annotated[Path | None, typer.Option(metavar="FILE", help="default: the shipped set (required "
                                                                               "with --libraries)")] = None) -> None:
    """Write the task records from the pinned mutations."""
    from envs.images import build_image
    from envs.tasks import build

    _, libs = _libraries(libraries, library)
    pinned = _mutations(libraries, mutations, out, "build")
    for lib in libs:
        lib.need("tests", "license", for_what="build")
        build_image(lib.recipe, log=say)
    build.build(libs, out=out or SHIPPED, mutations=pinned, log=say)


@app.command()
@_said
def fixes(repo: Annotated[list[str] | None, typer.Option(metavar="OWNER/NAME", help="only these repositories "
                                                                                   "(repeatable)")] = None,
          out: Annotated[Path | None, typer.Option(metavar="FILE", help="default: the shipped "
                                                                        "envs/tasks/fixes_tasks.jsonl")] = None) -> None:
    """SWE-bench-shaped records of real upstream fixes between consecutive releases.

    Their images are in SWE-bench's layout (envs/tasks/fixes.py)."""
    from envs.tasks import fixes as upstream

    releases = [r for r in upstream.load_releases() if not repo or r.repo in repo]
    upstream.build(releases, out=out or upstream.RECORDS_FILE, log=say)


@app.command()
@_said
def validate(libraries: Libraries = LIBRARIES_FILE, library: Only = None,
             tasks: Annotated[Path, typer.Option(metavar="FILE", show_default=False,
                                                 help="task records (default: the shipped set)")] = SHIPPED,
             every: Annotated[bool, typer.Option("--all", help="every task (the default)")] = False,
             sample: Annotated[int | None, typer.Option(help="this many tasks, spread over the repositories")] = None,
             seed: Seed = 0,
             budget: Annotated[float | None, typer.Option(help="stop starting new tasks after this many "
                                                               "seconds")] = None,
             no_images: Annotated[bool, typer.Option("--no-images", help="do not build the images first")] = False,
             dataset: Dataset = None,
             workers: Annotated[int, typer.Option(help="records validated at a time")] = 2) -> None:
    """Check a task set: the gold patch resolves, unchanged and wrong patches do not.

    By each record's runner, in parallel; a table of a row per record."""
    from envs.tasks import build
    from envs.tasks.validate import table
    from envs.tasks.validate import validate as check

    if every and sample is not None:
        raise typer.BadParameter("give --all or --sample N, not both", param_hint="--all / --sample")
    _, libs = _libraries(libraries, library)
    records = load_tasks(tasks, dataset=dataset)
    chosen = build.sample(records, sample, seed) if sample else records
    unusable = build.prepare_images(chosen, libs, build=not no_images, libraries_file=str(libraries), log=say)
    verdicts = check(chosen, workers=workers, budget=budget, unusable=unusable, log=say)
    for row in table(verdicts):
        say(row)
    bad = [v for v in verdicts if not v.ok]
    print(f"[validate] {len(verdicts) - len(bad)}/{len(verdicts)} tasks valid ({len(records)} in the set)")
    _exit(1 if bad or not verdicts else 0)


@app.command()
@_said
def prewarm(tasks: Annotated[Path, typer.Option(metavar="FILE", help="task records (JSONL, JSON, Parquet)")],
            dataset: Dataset = None,
            url: Annotated[list[str] | None, typer.Option(metavar="URL", help="an env server (repeatable; default: "
                                                          "the Ray fleet of `agentenv cluster up`)")] = None,
            ray_address: Annotated[str | None, typer.Option(metavar="ADDRESS", help="the Ray cluster of the fleet "
                                                                                    "(default: auto)")] = None,
            token_file: TokenFile = None,
            deadline: Annotated[float | None, typer.Option(help="seconds each pull may take (at most the servers' "
                                                                "own)")] = None) -> None:
    """Get a task set's images onto every env server (a Ray fleet or --url).

    A line per image and server as each is done; exit code 1 when one could not be had."""
    from agentenv.remote.prewarm import Warmed, prewarm_fleet
    from agentenv.remote.prewarm import prewarm as warm

    records = load_tasks(tasks, dataset=dataset)
    names = list(dict.fromkeys(t.image for t in records))
    token = read_token(token_file, "AGENTENV_TOKEN")
    if not token:
        raise TaskError("the servers' token: give --token-file FILE or set $AGENTENV_TOKEN")

    def show(w: Warmed, done: int, total: int) -> None:
        what = f"from {w.source} in {w.seconds:.1f} s" if w.ok else f"FAILED: {w.error}"
        say(f"[prewarm {done}/{total}] {w.url} {w.image}: {what}")

    say(f"[prewarm] {len(names)} image(s) of {len(records)} task(s)")
    got = (warm(url, token, names, deadline=deadline, on_progress=show) if url else
           prewarm_fleet(token, names, address=ray_address, deadline=deadline, on_progress=show))
    bad = [w for w in got if not w.ok]
    say(f"[prewarm] {len(got) - len(bad)}/{len(got)} image(s) on their servers")
    _exit(1 if bad else 0)
