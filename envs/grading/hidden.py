"""What a task hides from the agent, put back for grading only (R2E-Gym's ``/r2e_tests`` and ``run_tests.sh``).

At reset ``envs.task_sandbox.start_task`` removes a task's ``hidden_paths`` before the agent starts, and the
pristine snapshot grading restores is taken after that. Grading takes them from the image itself: a sandbox of
the task's image, in which nothing but ``tar`` runs, packs them (``pack``), and the grading sandbox unpacks them
once the agent's patch is applied and before the tests run (``restore_lines``, a step of
``envs.grading.prepare``'s script), removing first whatever stands at those paths: the files the tests read
are the image's, byte for byte, whatever the patch did.

Why from the image, not from a pristine snapshot taken before hiding: every sandbox the agent is given for the
same task again is restored from that snapshot, and each would have to hide them again; taken from the image,
no state an agent's sandbox ever comes from holds them.

What a patch can do about them: nothing. ``/r2e_tests`` is outside /testbed, where ``git apply`` writes
nothing and a link the patch makes out of /testbed fails the grading; a hidden path inside /testbed
(``run_tests.sh``) is a protected file, dropped from the patch like the tests (``inside``); the restore replaces
both after the patch; and while the tests run, the guard refuses the patch's code any access to them
(``guard_paths``), as it does to the grading folder.
"""

from __future__ import annotations

import posixpath
import shlex

from agentenv.api import Backend
from envs.grading.patch import WORKDIR
from envs.task import Task

ARCHIVE = "hidden.tar"                  # in the grading folder
MAX_BYTES = 256 << 20                   # what the hidden paths may hold, packed
_PACKED = "/tmp/agentenv-hidden.tar"    # in the image's sandbox


def inside(task: Task) -> list[str]:
    """The task's hidden paths under /testbed, relative to it (protected from the patch like test files)."""
    return [p[len(WORKDIR) + 1:] for p in task.hidden_paths if p.startswith(WORKDIR + "/")]


def guard_paths(task: Task, links: tuple[str, ...] = ()) -> list[str]:
    """The paths the guard refuses the patch's code while the tests run: the hidden ones, and ``links`` (paths
    under /testbed a runner links to them, e.g. R2E-Gym's ``r2e_tests``)."""
    return [*task.hidden_paths, *(posixpath.join(WORKDIR, link) for link in links)] if task.hidden_paths else []


def pack(task: Task, api: Backend) -> bytes:
    """The task's hidden paths as its image holds them: a tar archive of those it has (b"" when none)."""
    from envs.task_sandbox import SetupError, image_sandbox

    names = " ".join(shlex.quote(p.lstrip("/")) for p in task.hidden_paths)
    script = (f"cd / && set -- && for p in {names}; do if [ -e \"$p\" ] || [ -L \"$p\" ]; then set -- \"$@\" \"$p\"; "
              f"fi; done; if [ $# -eq 0 ]; then echo none; exit 0; fi; tar -cf {_PACKED} -- \"$@\" && "
              f"stat -c 'size=%s' {_PACKED}")
    sb = image_sandbox(task, api, {"agentenv.kind": "grading"}, cpus=1.0, memory="512m")
    try:
        r = sb.exec(script, timeout=300, cwd="/")
        out = r.stdout.strip().splitlines()
        if r.exit_code != 0 or not out or not (out[-1] == "none" or out[-1].startswith("size=")):
            raise SetupError(f"task {task.instance_id}: could not pack its hidden paths from {task.image} "
                             f"({r.exit_code}): {(r.stdout + r.stderr).strip()[-400:]}",
                             fix="check that the image has tar and the paths in 'hidden_paths'")
        if out[-1] == "none":
            return b""
        size = int(out[-1].removeprefix("size="))
        if size > MAX_BYTES:
            raise SetupError(f"task {task.instance_id}: its hidden paths hold {size} bytes packed, over "
                             f"{MAX_BYTES}", fix="hide less (field 'hidden_paths')")
        return sb.read_file(_PACKED)
    finally:
        sb.close()


def restore_lines(task: Task, folder: str, packed: bool) -> list[str]:
    """Shell lines (run as root in the grading sandbox, after the patch) that put the hidden paths back as the
    image has them; ``packed``: ``folder/ARCHIVE`` holds them (``pack`` found some)."""
    if not task.hidden_paths:
        return []
    quoted = " ".join(shlex.quote(p) for p in task.hidden_paths)
    lines = [f"rm -rf -- {quoted} 2> {folder}/err || {{ echo \"fail=hidden $(base64 -w0 {folder}/err)\"; exit 0; }}"]
    if packed:
        lines.append(f"tar -C / -xpf {folder}/{ARCHIVE} 2> {folder}/err || "
                     f"{{ echo \"fail=hidden $(base64 -w0 {folder}/err)\"; exit 0; }}")
    return lines
