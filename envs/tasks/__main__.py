"""``python -m envs.tasks``: the task sets' commands as they were run before ``agentenv tasks`` (``envs.tasks.cli``,
the same typer app); kept for a release, it says it is deprecated. ``main`` runs the app on a list of words and
answers its exit code, for a caller that is not a shell (the integration tests)."""

from __future__ import annotations

import sys

import typer

from envs.tasks.cli import app, say


def main(argv: list[str] | None = None) -> int:
    """The exit code of ``agentenv tasks ARGV`` run in this process (its usage errors and help printed as there)."""
    try:
        typer.main.get_command(app).main(args=argv, prog_name="agentenv tasks", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return 0


if __name__ == "__main__":
    say("note: `python -m envs.tasks` is deprecated and goes in the next release: run `agentenv tasks` (same "
        "commands and options)", file=sys.stderr)
    sys.exit(main())
