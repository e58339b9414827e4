"""The records of real upstream fixes (``envs/tasks/fixes_tasks.jsonl``) and their images, for the integration tests
and bench/fixes_grading.py: the images built (or found up to date: their inputs are their cache key) once per
session, a record loaded as a Task, and a patch made in a sandbox of the record as an agent would make it."""

from __future__ import annotations

from collections.abc import Callable

from agentenv.api import SandboxLike
from envs.grading import GradeResult, grade
from envs.task import Task, load_tasks
from envs.task_sandbox import start_task
from envs.tasks.fixes import RECORDS_FILE, load_releases

_BUILT: set[str] = set()


def build_images(repos: tuple[str, ...] = ()) -> None:
    """Each release's image (one per repository and version, tagged once per instance), built once per process."""
    from envs.images import build_image

    for release in load_releases():
        if (not repos or release.repo in repos) and release.repo not in _BUILT:
            build_image(release.recipe)
            _BUILT.add(release.repo)


def record(instance_id: str) -> Task:
    """The record as a Task."""
    for task in load_tasks(RECORDS_FILE):
        if task.instance_id == instance_id:
            return task
    raise KeyError(instance_id)


def graded(task: Task, edit: Callable[[SandboxLike], None] | None = None) -> GradeResult:
    """``task`` graded after ``edit`` changed its sandbox (None: the repository left as it is)."""
    sb, task = start_task(task)
    try:
        if edit is not None:
            edit(sb)
        return grade(sb, task)
    finally:
        sb.close()


def applying(patch: str) -> Callable[[SandboxLike], None]:
    def edit(sb: SandboxLike) -> None:
        sb.write_file("/tmp/edit.patch", patch)
        r = sb.exec("git apply /tmp/edit.patch && rm /tmp/edit.patch", cwd="/testbed")
        assert r.exit_code == 0, r.stderr
    return edit


def writing(files: dict[str, str], append: bool = False) -> Callable[[SandboxLike], None]:
    """Write (or append to) files of /testbed."""
    def edit(sb: SandboxLike) -> None:
        for path, text in files.items():
            old = sb.read_file(f"/testbed/{path}").decode() if append else ""
            sb.write_file(f"/testbed/{path}", old + text)
    return edit


def replacing(path: str, old: str, new: str) -> Callable[[SandboxLike], None]:
    """Replace the first ``old`` in a file of /testbed by ``new`` (it must be there)."""
    def edit(sb: SandboxLike) -> None:
        text = sb.read_file(f"/testbed/{path}").decode()
        assert old in text, f"{old!r} is not in {path}"
        sb.write_file(f"/testbed/{path}", text.replace(old, new, 1))
    return edit
