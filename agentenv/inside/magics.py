"""IPython's line syntax for the run_code kernel (``kernel.py``), and its bash cells: standard library only.

Notebook code sent to ``run_code`` (smolagents' ``install_packages``, agents that learnt on Jupyter) has lines
that are not Python: ``!cmd``, ``x = !cmd``, ``%pip install ...``, ``%cd``, ``%env``, and a first line
``%%bash`` that makes the whole cell a shell script. :func:`transform` turns each such line into a call of the
builtin ``MAGIC`` before the cell is parsed, as IPython's input transformers do: only lines that start a logical
line (never a line inside a string or a bracket, found with ``tokenize``), indentation kept, one line for one,
so tracebacks keep their line numbers. A cell with no such line is left as it is. :class:`Magics` runs the
calls; commands inherit the kernel's fds 1 and 2, so their output streams as the cell's stdout and stderr. An
unknown magic is a ``UsageError`` result, never skipped.

:class:`Shell` runs ``language="bash"`` requests: each one a bash script in the context's folder, with the
variables, functions and folder that the previous one left (saved by an EXIT trap, replayed before the next).

In a sandbox this file runs joined to kernel.py (``kernel.launch``): its names are globals of that one module.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import signal
import site
import subprocess
import sys
import tempfile
import tokenize
from typing import Any

MAGIC = "__agentenv_magic__"  # the builtin that a transformed line calls
# a line starting with optional indentation, an optional ``names =``, then ``!``, ``!!`` or ``%``
_ESCAPED = re.compile(r"^([ \t]*)(?:([A-Za-z_][\w.]*(?:[ \t]*,[ \t]*[A-Za-z_][\w.]*)*)[ \t]*=[ \t]*)?(!!?|%)(.*?)\r?$")
_ANY = re.compile(r"^[ \t]*(?:[\w., \t]*=[ \t]*)?[!%]", re.M)  # the fast test: might a line be one?
_FIELD = re.compile(r"\{([^{}\n]+)\}")
_DOLLAR = re.compile(r"\$(\$|[A-Za-z_]\w*)")
LINE_MAGICS = ("cd", "env", "pip", "pwd", "sx", "system")
CELL_MAGICS = ("bash", "sh", "writefile")


class UsageError(Exception):
    """A magic that does not exist here, or was called wrongly (IPython's name for it)."""


class SList(list[str]):
    """The lines of a captured command (``x = !cmd``), with IPython's ``.s``, ``.n`` and ``.l``."""

    @property
    def s(self) -> str:
        return " ".join(self)

    @property
    def n(self) -> str:
        return "\n".join(self)

    @property
    def l(self) -> list[str]:  # noqa: E743 (IPython's name)
        return list(self)


def _starts(source: str) -> set[int]:
    """The rows (from 1) whose first token starts a logical line: not in a string, a bracket or a backslash's
    continuation. Where tokenize gives up, what it read so far stands (the parser reports the rest)."""
    rows: set[int] = set()
    depth, fresh = 0, True
    skip = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in skip:
                continue
            if tok.type == tokenize.NEWLINE:
                fresh = True
                continue
            if fresh and depth == 0:
                rows.add(tok.start[0])
            fresh = False
            if tok.type == tokenize.OP and tok.string in ("(", "[", "{"):
                depth += 1
            elif tok.type == tokenize.OP and tok.string in (")", "]", "}"):
                depth = max(0, depth - 1)
    except (tokenize.TokenError, SyntaxError, ValueError):
        pass
    return rows


def transform(code: str) -> str:
    """``code`` with its IPython lines as calls of ``MAGIC`` (``code`` itself where it has none).

    A line that looks like one may be inside a string or a bracket: each candidate is first replaced by ``pass``
    (a whole statement, as its call will be) and the cell tokenized once; the first candidate found not to
    start a logical line is put back as written, and the cell tokenized again, until every one left starts one
    (a pass per candidate inside a string, at most)."""
    lines = code.splitlines(keepends=True)
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is not None and lines[first].lstrip().startswith("%%"):
        head = lines[first].strip()[2:]
        return f"{MAGIC}('%%', {head!r}, {''.join(lines[first + 1:])!r})\n"
    if not _ANY.search(code):
        return code
    found = {i: m for i, line in enumerate(lines) if (m := _ESCAPED.match(line.rstrip("\n")))}
    while found:
        starts = _starts("".join(f"{found[i].group(1)}pass\n" if i in found else line for i, line in enumerate(lines)))
        inside = [i for i in sorted(found) if i + 1 not in starts]
        if not inside:
            break
        del found[inside[0]]
    out = list(lines)
    for i, match in found.items():
        indent, target, escape, rest = match.groups()
        if target and escape == "!":
            escape = "!!"  # x = !cmd captures
        call = f"{MAGIC}({escape!r}, {rest!r})"
        out[i] = f"{indent}{target} = {call}\n" if target else f"{indent}{call}\n"
    return "".join(out)


def _expand(command: str, frame: Any) -> str:
    """IPython's expansion of ``{expr}`` and ``$name`` from the caller's variables; what fails stays as written."""
    scope = {**frame.f_globals, **frame.f_locals} if frame is not None else {}

    def field(m: re.Match[str]) -> str:
        try:
            return str(eval(m.group(1), scope))  # noqa: S307 (the user's own expression, in the user's kernel)
        except Exception:
            return m.group(0)

    def dollar(m: re.Match[str]) -> str:
        name = m.group(1)
        return "$" if name == "$" else str(scope[name]) if name in scope else m.group(0)

    return _DOLLAR.sub(dollar, _FIELD.sub(field, command))


def _wait(proc: subprocess.Popen[Any]) -> int:
    """``proc``'s exit status; an interrupt kills its whole session (the command's children too) first."""
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _spawn(args: Any, *, shell: bool = False, capture: bool = False,
           env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a command with the kernel's fds 1 and 2 (its output streams), or its stdout captured."""
    _flush()
    proc = subprocess.Popen(args, shell=shell, stdin=subprocess.DEVNULL, start_new_session=True,
                            stdout=subprocess.PIPE if capture else None, env=env)
    out = ""
    if capture:
        assert proc.stdout is not None
        try:
            out = proc.stdout.read().decode("utf-8", "replace")
        except BaseException:
            _wait(proc)
            raise
        finally:
            proc.stdout.close()
    return _wait(proc), out


def _script(shell: str, body: str) -> int:
    """Run ``body`` as a ``shell`` script from a file (stdin stays /dev/null, for the script's commands)."""
    fd, path = tempfile.mkstemp(prefix="agentenv-cell-", suffix=".sh")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
        return _spawn([shell, path])[0]
    finally:
        os.unlink(path)


class Magics:
    """What the lines of :func:`transform` call: ``MAGIC(escape, text[, body])``."""

    def __init__(self, ns: dict[str, Any]) -> None:
        self.ns = ns
        self.oldpwd = os.getcwd()

    def __call__(self, escape: str, text: str, body: str | None = None) -> Any:
        frame = sys._getframe(1)
        if escape in ("!", "!!"):
            return self.system(_expand(text, frame), escape == "!!")
        name, _, arg = text.strip().partition(" ")
        arg = arg.strip()
        if escape == "%%":
            if name not in CELL_MAGICS:
                raise UsageError(f"Cell magic `%%{name}` not found (this kernel has %%"
                                 f"{', %%'.join(CELL_MAGICS)})")
            return getattr(self, f"cell_{name}")(arg, body or "")
        if name not in LINE_MAGICS:
            raise UsageError(f"Line magic function `%{name}` not found (this kernel has %"
                             f"{', %'.join(LINE_MAGICS)} and !commands)")
        return getattr(self, f"line_{name}")(_expand(arg, frame) if name in ("pip", "sx", "system") else arg)

    def system(self, command: str, capture: bool) -> SList | None:
        shell = os.environ.get("SHELL") or "/bin/sh"
        code, out = _spawn([shell, "-c", command], capture=capture)
        self.ns["_exit_code"] = code  # as IPython: a failing !command is not an error, its status is kept
        return SList(out.splitlines()) if capture else None

    def line_sx(self, arg: str) -> SList | None:
        return self.system(arg, True)

    def line_system(self, arg: str) -> SList | None:
        return self.system(arg, True)

    def line_pip(self, arg: str) -> None:
        # the sandbox's Python is its own to change, as in E2B's images: Debian marks it externally managed
        # (PEP 668), which would refuse every install; a caller's own setting of the variable wins
        env = {"PIP_BREAK_SYSTEM_PACKAGES": "1", **os.environ}
        code, _ = _spawn([sys.executable, "-m", "pip", *shlex.split(arg)], env=env)
        user_site = site.getusersitepackages()  # an account's first install makes it (site skips it when absent)
        if site.ENABLE_USER_SITE and os.path.isdir(user_site) and user_site not in sys.path:
            site.addsitedir(user_site)
        importlib.invalidate_caches()  # what was installed can be imported now
        if code:
            raise subprocess.CalledProcessError(code, f"pip {arg}".strip())

    def line_cd(self, arg: str) -> None:
        words = shlex.split(arg)
        if len(words) > 1 or (words and words[0].startswith("-") and words[0] != "-"):
            raise UsageError(f"%cd takes one folder (or -), not {arg!r}")
        target = (self.oldpwd if words[0] == "-" else os.path.expanduser(words[0])) if words else \
            os.path.expanduser("~")
        old = os.getcwd()
        os.chdir(target)
        self.oldpwd = old
        os.environ["PWD"] = os.getcwd()
        print(os.getcwd())

    def line_pwd(self, arg: str) -> str:
        return os.getcwd()

    def line_env(self, arg: str) -> Any:
        if not arg:
            return dict(os.environ)
        name, sep, value = arg.partition("=")
        if not sep:
            name, _, value = arg.partition(" ")
            if not value:
                if name not in os.environ:
                    raise UsageError(f"Environment does not have key: {name}")
                return os.environ[name]
        name, value = name.strip(), value.strip()
        os.environ[name] = value
        print(f"env: {name}={value}")
        return None

    def cell_bash(self, arg: str, body: str) -> None:
        self._cell("bash", arg, body)

    def cell_sh(self, arg: str, body: str) -> None:
        self._cell("sh", arg, body)

    def _cell(self, shell: str, arg: str, body: str) -> None:
        if arg:
            raise UsageError(f"%%{shell} takes no options here, not {arg!r}")
        code = _script(shell, body)
        if code:
            raise subprocess.CalledProcessError(code, shell)

    def cell_writefile(self, arg: str, body: str) -> None:
        words = shlex.split(arg)
        append = words[:1] in (["-a"], ["--append"])
        if append:
            words = words[1:]
        if len(words) != 1:
            raise UsageError("%%writefile [-a] FILE")
        path = os.path.expanduser(words[0])
        print(("Appending to " if append else "Overwriting " if os.path.exists(path) else "Writing ") + words[0])
        with open(path, "a" if append else "w", encoding="utf-8") as f:
            f.write(body)


# the state a bash request leaves for the next: variables (not bash's own), functions, the folder
_SAVE = r"""__agentenv_save() {
  local __n
  { for __n in $(compgen -v); do
      case $__n in BASH*|EUID|PPID|UID|SHELLOPTS|RANDOM|SRANDOM|SECONDS|LINENO|EPOCH*|HISTCMD|FUNCNAME|GROUPS|\
DIRSTACK|PIPESTATUS|SHLVL|PWD|OLDPWD|COMP_WORDBREAKS|_|__n|__agentenv_*) continue;; esac
      declare -p "$__n" 2>/dev/null
    done
    declare -f
    printf 'cd -- %q\n' "$PWD"
  } > "$__agentenv_state" 2>/dev/null
}
trap __agentenv_save EXIT
"""


class Shell:
    """``language="bash"`` requests of one context: a bash script each, the state of the one before replayed."""

    def __init__(self) -> None:
        self.state = ""

    def run(self, code: str, env: dict[str, str]) -> int:
        folder = tempfile.mkdtemp(prefix="agentenv-bash-")
        state, user = os.path.join(folder, "state"), os.path.join(folder, "cell.sh")
        lines = ["{", self.state, ":; } 2>/dev/null"]  # bash's read-only variables refuse; the rest comes back
        lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items() if re.fullmatch(r"[A-Za-z_]\w*", k)]
        lines += [f"__agentenv_state={shlex.quote(state)}", _SAVE.replace("__n|", "__n|" + "".join(
            f"{k}|" for k in env if re.fullmatch(r"[A-Za-z_]\w*", k))), f". {shlex.quote(user)}"]
        try:
            with open(user, "w", encoding="utf-8") as f:
                f.write(code)
            with open(os.path.join(folder, "run.sh"), "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
            code_ = _spawn(["bash", "--noprofile", "--norc", os.path.join(folder, "run.sh")])[0]
            try:
                with open(state, encoding="utf-8", errors="surrogateescape") as f:
                    self.state = f.read()
            except OSError:
                pass  # the script took the EXIT trap away: the state stays as it was
            return code_
        finally:
            for name in ("state", "cell.sh", "run.sh"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
            with contextlib.suppress(OSError):  # the script may have left files of its own there
                os.rmdir(folder)
