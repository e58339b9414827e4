"""python -m envs.tasks images | search | build | validate — build and check the shipped SWE task set."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from envs.task import SHIPPED, load_tasks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.tasks", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    im = sub.add_parser("images", help="build (or find up to date) one image per pinned library")
    im.add_argument("--library", action="append", help="only these libraries (repeatable)")
    im.add_argument("--force", action="store_true")
    se = sub.add_parser("search", help="find mutations the libraries' tests catch; pin them in mutations.json")
    se.add_argument("--library", action="append")
    se.add_argument("--keep", type=int, default=9, help="mutations to keep per library")
    se.add_argument("--max-tries", type=int, default=80, help="test runs per library at most")
    se.add_argument("--seed", type=int, default=0)
    bu = sub.add_parser("build", help="write the task records from the pinned mutations")
    bu.add_argument("--library", action="append")
    bu.add_argument("--out", type=Path, default=SHIPPED)
    va = sub.add_parser("validate", help="gold patch resolves; unchanged and wrong patches do not")
    va.add_argument("--tasks", type=Path, default=SHIPPED)
    group = va.add_mutually_exclusive_group()
    group.add_argument("--all", action="store_true", help="every task (the default)")
    group.add_argument("--sample", type=int, help="this many tasks, spread over the libraries")
    va.add_argument("--seed", type=int, default=0)
    va.add_argument("--budget", type=float, help="stop starting new tasks after this many seconds")
    va.add_argument("--no-images", action="store_true", help="do not build the images first")
    args = p.parse_args(argv)

    from envs.images import build_image
    from envs.tasks import build
    from envs.tasks.libraries import load_libraries

    libs = [lib for lib in load_libraries() if not getattr(args, "library", None) or lib.name in args.library]
    if args.cmd == "images":
        for lib in libs:
            build_image(lib.recipe, force=args.force, log=print)
        return 0
    if args.cmd == "search":
        found = build.read_mutations() if build.MUTATIONS_FILE.exists() else {}
        for lib in libs:
            build_image(lib.recipe, log=print)
            found[lib.name] = build.search(lib, keep=args.keep, max_tries=args.max_tries, seed=args.seed, log=print)
            build.write_mutations(found, args.seed)
        return 0
    if args.cmd == "build":
        for lib in libs:
            build_image(lib.recipe, log=print)
        build.build(libs, out=args.out)
        return 0
    tasks = load_tasks(args.tasks)
    chosen = build.sample(tasks, args.sample, args.seed) if args.sample else tasks
    if not args.no_images:
        images = {t.image for t in chosen}
        for lib in load_libraries():
            if lib.image in images:
                build_image(lib.recipe, log=print)
    verdicts = build.validate(chosen, budget=args.budget)
    bad = [v for v in verdicts if not v.ok]
    print(f"[validate] {len(verdicts) - len(bad)}/{len(verdicts)} tasks valid ({len(tasks)} in the set)")
    return 1 if bad or not verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
