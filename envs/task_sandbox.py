"""The sandbox of an SWE task: the task's image with /testbed brought to the task's base commit.

Shared by the env (``SWEEnv.reset``) and the task-set tools (``envs.tasks``: build, validate).

At reset, after the task's setup commands (by default ``git checkout -f <base_commit>``), the
repository is scrubbed of everything past its base commit (``SCRUB``): an agent must not read the fix
from git history. Audits of agents on SWE-bench found them reading the fix from ``git log --all``,
tags or reflogs in a sizeable share of trajectories. What goes: every ref but HEAD's branch (other
branches, tags, remote-tracking refs, ``refs/stash``, notes, replace refs; packed or loose, and
``packed-refs`` is rewritten so no stale line names a later commit), the remotes, every reflog,
``ORIG_HEAD`` / ``FETCH_HEAD`` / ``MERGE_HEAD`` / ``COMMIT_EDITMSG`` and friends, worktrees. Then,
only when the object store holds objects that HEAD (and the index) cannot reach, a repack and prune
drop them, so ``git cat-file --batch-all-objects`` lists no commit or blob of the future. A
single-commit repository (every shipped task) has nothing to drop: the scrub is a handful of git
commands in one exec (~15 ms a reset). The script checks its own work (refs left, objects left) and
fails the reset when anything is left.

Images built from a long real history (one per task, at its base commit) can run the same script at
build time (``agentenv tasks scrub-script``): it records the state it leaves, and a reset that
finds that state unchanged skips counting the history's objects (and has nothing to repack).

A task whose ``base_commit`` is ``"HEAD"`` is at the commit the setup leaves (the image's HEAD without
setup commands); ``start_task`` returns the task with that commit filled in, which is what grading must
diff against.

What the datasets add (``envs.datasets``): a task's ``bug_patch`` (SWE-smith's published patch, which introduces
the bug; its instance branches live on GitHub) is applied after the setup and /testbed restarted as one commit
(``BUG_COMMIT``: fixed author and dates, so a fork or a second reset gets the same commit), which becomes the base
commit: the parent that would show the bug is gone. A task's ``hidden_paths`` (R2E-Gym's ``/r2e_tests`` and its
``run_tests.sh``) are removed before the agent starts; grading puts them back from the image.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

import agentenv
from agentenv.api import Backend, SandboxLike
from agentenv.errors import AgentEnvError, ImageNotFound, ImageUnavailable
from agentenv.harness.fetch import create_sandbox
from envs.base import TASK_LABEL
from envs.images import DOCS, build_hint
from envs.task import HEAD, Task

WORKDIR = "/testbed"

# POSIX sh, run in /testbed; prints "agentenv-scrub <head> <refs left> <objects> <reachable> <how>" and exits 0
# only when at most HEAD's branch is left and every object is reachable from HEAD or the index. It then
# records the state it left (HEAD and the object counts) in .git/agentenv-scrubbed: run at image build
# time (`agentenv tasks scrub-script`), that lets a reset skip counting a long history's objects.
SCRUB = r"""set -e
info=$(git rev-parse --absolute-git-dir 'HEAD^{commit}' --symbolic-full-name HEAD)
nl='
'
g=${info%%"$nl"*}; rest=${info#*"$nl"}; head=${rest%%"$nl"*}; branch=${rest#*"$nl"}
case "$g" in /*/*) ;; *) echo "not a git repository: $g" >&2; exit 3;; esac
[ -d "$g/objects" ] && [ ${#head} -ge 40 ] || { echo "HEAD is not a commit" >&2; exit 3; }
refs=$(git for-each-ref --format='%(refname)')
if [ "$refs" != "$branch" ]; then
  echo "$refs" | grep -vxF "$branch" | sed 's/^/delete /' | git update-ref --no-deref --stdin
fi
if grep -q '^\[remote ' "$g/config"; then for r in $(git remote); do git remote remove "$r"; done; fi
rm -rf "$g/logs" "$g/worktrees" "$g/rebase-merge" "$g/rebase-apply" "$g/sequencer" "$g/lost-found" \
  "$g/refs/original" "$g/info/refs" "$g/objects/info/packs" "$g/ORIG_HEAD" "$g/FETCH_HEAD" "$g/MERGE_HEAD" \
  "$g/MERGE_MSG" "$g/MERGE_MODE" "$g/MERGE_RR" "$g/CHERRY_PICK_HEAD" "$g/REVERT_HEAD" "$g/AUTO_MERGE" \
  "$g/REBASE_HEAD" "$g/COMMIT_EDITMSG" "$g/SQUASH_MSG" "$g"/BISECT_*
if [ -e "$g/packed-refs" ]; then git pack-refs --all; fi
stats() { git count-objects -v | awk '{v[$1]=$2} END{print v["count:"]+v["in-pack:"], v["count:"], v["size:"],
  v["in-pack:"], v["packs:"], v["size-pack:"]}'; }
state="$head $(stats)"; all=${state#* }; all=${all%% *}
mark=; if [ -f "$g/agentenv-scrubbed" ]; then read -r mark < "$g/agentenv-scrubbed" || true; fi
how=counted
if [ "$mark" = "$state" ] && [ ! -e "$g/objects/info/alternates" ]; then
  reach=$all; how=marked  # scrubbed at this very state before (an image-level scrub): no need to count
else
  reach=$(git rev-list --objects --indexed-objects HEAD | wc -l)
fi
if [ "$all" -ne "$reach" ] || [ -e "$g/objects/info/alternates" ]; then
  rm -rf "$g"/objects/pack/*.keep "$g/objects/info/commit-graph" "$g/objects/info/commit-graphs" \
    "$g/objects/pack/multi-pack-index"
  git repack -a -d -q
  rm -f "$g/objects/info/alternates"
  git prune --expire=now
  how=repacked
  state="$head $(stats)"; all=${state#* }; all=${all%% *}
fi
left=$refs
if [ "$refs" != "$branch" ]; then left=$(git for-each-ref --format='%(refname)'); fi
if [ -z "$left" ]; then n=0; elif [ "$left" = "$branch" ]; then n=1; else n=more; fi
echo "agentenv-scrub $head $n $all $reach $how"
[ "$n" != more ] && [ "$all" -eq "$reach" ] && [ ! -e "$g/logs" ]
echo "$state" > "$g/agentenv-scrubbed"
"""


PATCH_EOF = "AGENTENV_BUG_PATCH_EOF"
BUG_COMMIT = ("rm -rf .git && git init -q && git add -A && GIT_AUTHOR_NAME=agentenv GIT_COMMITTER_NAME=agentenv "
              "GIT_AUTHOR_EMAIL=agentenv@localhost GIT_COMMITTER_EMAIL=agentenv@localhost "
              "GIT_AUTHOR_DATE=2000-01-01T00:00:00+0000 GIT_COMMITTER_DATE=2000-01-01T00:00:00+0000 "
              "git commit -q -m base")


def bug_commands(bug_patch: str) -> list[str]:
    """Shell commands (in /testbed) that apply a task's ``bug_patch`` and restart the history at the result."""
    body = bug_patch if bug_patch.endswith("\n") else bug_patch + "\n"
    if PATCH_EOF in body:
        raise SetupError(f"the bug patch holds the line {PATCH_EOF}, which ends the here-document that carries it")
    return [f"git apply --whitespace=nowarn <<'{PATCH_EOF}'\n{body}{PATCH_EOF}", BUG_COMMIT]


def hide_command(paths: tuple[str, ...]) -> str:
    """Remove ``paths`` and check that they are gone (a path the image lacks is fine: nothing to hide)."""
    quoted = " ".join(shlex.quote(p) for p in paths)
    return f"rm -rf -- {quoted} && for p in {quoted}; do if [ -e \"$p\" ] || [ -L \"$p\" ]; then " \
           f"echo \"$p is still there\"; exit 3; fi; done"


class SetupError(AgentEnvError):
    """A task's sandbox could not be brought to its base commit."""


class TaskImageMissing(SetupError, LookupError):
    """The image a task names (field ``image``) is not on the sandbox host and none of its sources had it; says
    why (``reason``: what each source answered) and how to get it."""

    def __init__(self, task: Task, reason: str = "") -> None:
        self.task_id, self.field, self.image = task.instance_id, "image", task.image
        self.repo, self.version, self.reason = task.repo, task.version, reason
        why = f" ({reason})" if reason else ""
        super().__init__(f"task {task.instance_id!r}: field 'image': image {task.image!r} ({task.dataset} record, "
                         f"repository {task.repo!r}, version {task.version or '?'!r}) is not on the sandbox host"
                         f"{why}", fix=build_hint(task.image) if task.dataset == "agentenv" else
                         "load it (AGENTENV_IMAGE_TARBALLS), mirror it (AGENTENV_IMAGE_MIRRORS) or pull it where a "
                         "registry is reachable; `agentenv tasks prewarm` fetches a task set's images")


def image_sandbox(task: Task, api: Backend, labels: dict[str, str] | None = None, **kwargs: Any) -> SandboxLike:
    """A sandbox of ``task.image`` as the image is (nothing run in it), the image fetched by its dataset's rule
    when the host lacks it (``TaskImageMissing`` when no source has it)."""
    try:
        return create_sandbox(api, task.image, labels={TASK_LABEL: task.instance_id, **(labels or {})}, **kwargs)
    except ImageUnavailable as e:  # no tarball, mirror or registry had it: each one's answer
        raise TaskImageMissing(task, str(e)) from e
    except ImageNotFound as e:
        why = "" if callable(getattr(api, "ensure_image", None)) else \
            "this backend cannot fetch images: prewarm its servers (agentenv tasks prewarm)"
        raise TaskImageMissing(task, why) from e


def start_task(task: Task, api: Backend = agentenv, **sandbox_kwargs: Any) -> tuple[SandboxLike, Task]:
    """A sandbox of ``task.image`` with /testbed at the task's base commit and no future in its git history,
    and the task with its base commit resolved (``"HEAD"`` replaced by the commit). Grade against that task.
    """
    sb = image_sandbox(task, api, **{"cpus": 1.0, "memory": "2g", **sandbox_kwargs})
    try:
        # a bug patch is applied to the image's commit, and its commit (fixed dates) is the base: the same each time
        checkout = HEAD if task.bug_patch else task.base_commit
        base = shlex.quote(checkout)
        commands = list(task.setup_commands) or [
            f"git cat-file -e {base}^{{commit}} 2>/dev/null || {{ echo \"commit {checkout} is not in the "
            f"repository (the image is at $(git rev-parse HEAD 2>&1))\"; exit 2; }}; "
            f"git checkout -q -f {base} && git clean -fdq"]
        if task.bug_patch:
            commands += bug_commands(task.bug_patch)
        if task.hidden_paths:
            commands.append(hide_command(task.hidden_paths))
        for cmd in commands:
            r = sb.exec(cmd, timeout=300, cwd=WORKDIR)
            if r.exit_code != 0:
                raise SetupError(f"task {task.instance_id}: setup command failed ({r.exit_code}): "
                                 f"{(r.stdout + r.stderr).strip()[-600:]}", fix=_setup_fix(task))
        r = sb.exec(SCRUB, timeout=600, cwd=WORKDIR)
        if r.exit_code != 0:  # the script checks its own work: refs left, objects left
            raise SetupError(f"task {task.instance_id}: could not scrub /testbed's git history past the base commit "
                             f"({r.exit_code}): {(r.stdout + r.stderr).strip()[-600:]}",
                             fix="check the image's /testbed repository (git fsck)")
        head = sb.exec("git rev-parse HEAD", timeout=60, cwd=WORKDIR).stdout.strip()
        resolve = task.base_is_head
        if not resolve and not head.startswith(task.base_commit):
            raise SetupError(f"task {task.instance_id}: /testbed is at {head}, not the base commit "
                             f"{task.base_commit}", fix=_setup_fix(task))
    except BaseException:
        sb.close()
        raise
    return sb, (dataclasses.replace(task, base_commit=head) if resolve else task)


def start_task_sandbox(task: Task, api: Backend = agentenv, **sandbox_kwargs: Any) -> SandboxLike:
    """``start_task`` without the resolved task (enough when ``task.base_commit`` is a commit hash)."""
    return start_task(task, api, **sandbox_kwargs)[0]


def _setup_fix(task: Task) -> str:
    return (f"the base commit must be one the image's /testbed holds: `agentenv tasks base-commit "
            f"{task.image}` prints the image's commit; or give \"base_commit\": \"HEAD\" (see {DOCS}); for "
            "shipped tasks, rebuild the image (agentenv tasks images)")
