"""agentenv tasks images | base-commit | scrub-script | search | build | fixes | validate | prewarm — SWE task sets.

The shipped set by default; any other with ``--libraries FILE`` (the libraries images are built from,
see envs/tasks/libraries.py) and ``--tasks FILE`` (task records, see envs/task.py: JSONL, JSON or Parquet, a
published dataset's records as they are; ``--dataset NAME`` when their fields cannot tell which, see
envs/datasets). ``prewarm`` gets a task set's images onto every env server of a fleet before a run.

``agentenv tasks`` (``envs.tasks.cli``, an ``agentenv.commands`` plugin) runs ``main``; ``python -m envs.tasks``
still does too, for a release, and says it is deprecated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from agentenv.terminal import clean
from envs.datasets import DATASETS
from envs.task import SHIPPED, TaskError, load_tasks
from envs.tasks.libraries import LIBRARIES_FILE, LibraryError


def say(text: str, file: TextIO | None = None) -> None:
    """Print a line whose text may come from a sandbox, a build or a test run, its escapes made visible."""
    print(clean(text), file=file or sys.stdout)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentenv tasks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def libraries(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--libraries", type=Path, default=LIBRARIES_FILE, metavar="FILE",
                        help="libraries file (default: the shipped envs/tasks/libraries.json)")
        sp.add_argument("--library", action="append", metavar="NAME", help="only these libraries (repeatable)")

    im = sub.add_parser("images", help="build (or find up to date) one image per library; prints its base commit")
    libraries(im)
    im.add_argument("--tasks", type=Path, metavar="FILE", help="only the images these tasks need")
    im.add_argument("--force", action="store_true")
    bc = sub.add_parser("base-commit", help="the commit an image's /testbed is at (a task's base_commit)")
    bc.add_argument("image", nargs="+")
    sub.add_parser("scrub-script", help="the sh script a reset runs in /testbed to drop git history past HEAD; "
                   "run it in an image built from a real history (RUN cd /testbed && git checkout -f BASE && "
                   "sh scrub.sh) so resets need not repack or count objects")
    se = sub.add_parser("search", help="find mutations the libraries' tests catch; pin them in a mutations file")
    libraries(se)
    se.add_argument("--mutations", type=Path, metavar="FILE", help="where to pin them (default: the shipped file; "
                    "required with --libraries)")
    se.add_argument("--keep", type=int, default=9, help="mutations to keep per library")
    se.add_argument("--max-tries", type=int, default=80, help="test runs per library at most")
    se.add_argument("--seed", type=int, default=0)
    bu = sub.add_parser("build", help="write the task records from the pinned mutations")
    libraries(bu)
    bu.add_argument("--mutations", type=Path, metavar="FILE", help="pinned mutations (default: the shipped file; "
                    "required with --libraries)")
    bu.add_argument("--out", type=Path, metavar="FILE", help="default: the shipped set (required with --libraries)")
    fx = sub.add_parser("fixes", help="SWE-bench-shaped records of real upstream fixes between consecutive releases, "
                        "their images in SWE-bench's layout (envs/tasks/fixes.py)")
    fx.add_argument("--repo", action="append", metavar="OWNER/NAME", help="only these repositories (repeatable)")
    fx.add_argument("--out", type=Path, metavar="FILE", help="default: the shipped envs/tasks/fixes_tasks.jsonl")
    va = sub.add_parser("validate", help="gold patch resolves; unchanged and wrong patches do not (by each record's "
                        "runner, in parallel; a per-record table)")
    libraries(va)
    va.add_argument("--tasks", type=Path, default=SHIPPED, metavar="FILE", help="default: the shipped set")
    group = va.add_mutually_exclusive_group()
    group.add_argument("--all", action="store_true", help="every task (the default)")
    group.add_argument("--sample", type=int, help="this many tasks, spread over the repositories")
    va.add_argument("--seed", type=int, default=0)
    va.add_argument("--budget", type=float, help="stop starting new tasks after this many seconds")
    va.add_argument("--no-images", action="store_true", help="do not build the images first")
    va.add_argument("--dataset", choices=DATASETS, help="the dataset the records come from (default: detected)")
    va.add_argument("--workers", type=int, default=2, help="records validated at a time (default: 2)")
    pw = sub.add_parser("prewarm", help="get a task set's images onto every env server (a Ray fleet or --url)")
    pw.add_argument("--tasks", type=Path, required=True, metavar="FILE", help="task records (JSONL, JSON, Parquet)")
    pw.add_argument("--dataset", choices=DATASETS, help="the dataset the records come from (default: detected)")
    pw.add_argument("--url", action="append", metavar="URL", help="an env server (repeatable; default: the Ray "
                    "fleet of `agentenv cluster up`)")
    pw.add_argument("--ray-address", metavar="ADDRESS", help="the Ray cluster of the fleet (default: auto)")
    pw.add_argument("--token-file", type=Path, metavar="FILE", help="file holding the servers' token (else "
                    "$AGENTENV_TOKEN)")
    pw.add_argument("--deadline", type=float, help="seconds each pull may take (at most the servers' own)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from agentenv.errors import AgentEnvError

    try:
        return _run(args)
    except (LibraryError, TaskError, AgentEnvError) as e:  # what to fix, not a traceback
        say(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from envs.images import build_image, image_head
    from envs.tasks import build
    from envs.tasks.libraries import load_libraries
    from envs.tasks.validate import table, validate

    if args.cmd == "scrub-script":
        from envs.task_sandbox import SCRUB

        print(SCRUB, end="")
        return 0
    if args.cmd == "prewarm":
        return _prewarm(args)
    if args.cmd == "fixes":
        from envs.tasks import fixes

        releases = [r for r in fixes.load_releases() if not args.repo or r.repo in args.repo]
        fixes.build(releases, out=args.out or fixes.RECORDS_FILE, log=say)
        return 0
    if args.cmd == "base-commit":
        for image in args.image:
            say(f"{image} {image_head(image)}")
        return 0
    all_libs = load_libraries(args.libraries)
    libs = [lib for lib in all_libs if not args.library or lib.name in args.library]
    if args.library and len(libs) < len(set(args.library)):
        missing = sorted(set(args.library) - {lib.name for lib in libs})
        raise LibraryError(f"no library {', '.join(missing)} in it", where=str(args.libraries))
    shipped = args.libraries == LIBRARIES_FILE
    if args.cmd == "images":
        rc = 0
        if args.tasks:
            tasks = load_tasks(args.tasks)
            made = {lib.image for lib in all_libs}
            others = [t for t in tasks if t.image not in made]  # images no library makes: must be here
            for why in build.prepare_images(others, [], build=False, libraries_file=str(args.libraries)).values():
                say(f"[image] {why}")
                rc = 1
            libs = [lib for lib in libs if lib.image in {t.image for t in tasks}]
        for lib in libs:
            build_image(lib.recipe, force=args.force, log=say)
        return rc
    if args.cmd in ("search", "build"):
        if not shipped and (args.mutations is None or (args.cmd == "build" and args.out is None)):
            need = "--mutations FILE" + (" and --out FILE" if args.cmd == "build" else "")
            raise LibraryError(f"with --libraries, give {need} (the shipped files are not overwritten)",
                               where=str(args.libraries))
        mutations = args.mutations or build.MUTATIONS_FILE
        if args.cmd == "search":
            found = build.read_mutations(mutations) if mutations.exists() else {}
            for lib in libs:
                lib.need("tests", "mutate", for_what="search")
                build_image(lib.recipe, log=say)
                found[lib.name] = build.search(lib, keep=args.keep, max_tries=args.max_tries, seed=args.seed, log=say)
                build.write_mutations(found, args.seed, mutations)
            return 0
        for lib in libs:
            lib.need("tests", "license", for_what="build")
            build_image(lib.recipe, log=say)
        build.build(libs, out=args.out or SHIPPED, mutations=mutations, log=say)
        return 0
    tasks = load_tasks(args.tasks, dataset=args.dataset)
    chosen = build.sample(tasks, args.sample, args.seed) if args.sample else tasks
    unusable = build.prepare_images(chosen, libs, build=not args.no_images, libraries_file=str(args.libraries),
                                    log=say)
    verdicts = validate(chosen, workers=args.workers, budget=args.budget, unusable=unusable, log=say)
    for row in table(verdicts):
        say(row)
    bad = [v for v in verdicts if not v.ok]
    print(f"[validate] {len(verdicts) - len(bad)}/{len(verdicts)} tasks valid ({len(tasks)} in the set)")
    return 1 if bad or not verdicts else 0


def _prewarm(args: argparse.Namespace) -> int:
    """Every image of the task set on every server; a line per image and server as each is done; non-zero when
    one could not be had."""
    from agentenv.cli.shared import read_token
    from agentenv.remote.prewarm import Warmed, prewarm, prewarm_fleet

    tasks = load_tasks(args.tasks, dataset=args.dataset)
    images = list(dict.fromkeys(t.image for t in tasks))
    import typer

    try:
        token = read_token(args.token_file, "AGENTENV_TOKEN")
    except typer.BadParameter as e:  # an empty or unreadable token file
        raise TaskError(e.message) from None
    if not token:
        raise TaskError("the servers' token: give --token-file FILE or set $AGENTENV_TOKEN")

    def show(w: Warmed, done: int, total: int) -> None:
        what = f"from {w.source} in {w.seconds:.1f} s" if w.ok else f"FAILED: {w.error}"
        say(f"[prewarm {done}/{total}] {w.url} {w.image}: {what}")

    say(f"[prewarm] {len(images)} image(s) of {len(tasks)} task(s)")
    got = (prewarm(args.url, token, images, deadline=args.deadline, on_progress=show) if args.url else
           prewarm_fleet(token, images, address=args.ray_address, deadline=args.deadline, on_progress=show))
    bad = [w for w in got if not w.ok]
    say(f"[prewarm] {len(got) - len(bad)}/{len(got)} image(s) on their servers")
    return 1 if bad else 0


if __name__ == "__main__":
    say("note: `python -m envs.tasks` is deprecated and goes in the next release: run `agentenv tasks` (same "
        "commands and options)", file=sys.stderr)
    sys.exit(main())
