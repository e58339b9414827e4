"""How a sandbox's PID 1 starts the keeper: its files joined into one, precompiled by the host where the
sandbox's Python can run it.

The keeper is written as a few standard-library modules in ``agentenv/inside`` (``PARTS``: the wire, the
image's accounts, terminals, starting commands, jobs, file calls, ports, the entry), which the host also imports. In a sandbox they run as one module: ``keeper_source``
joins them in order, without their imports of each other (every name is then a global of the one module) and
with one ``from __future__`` line on top; ``test_keeper_start`` checks that no part defines a name another does.

Every sandbox start (create, each fork child, restore of files only) waits for its keeper's first answer.
Run as a script, the keeper is compiled from source each time (a script's bytecode is never cached): about
10 ms of a start, more than the interpreter takes to come up. So the keeper's environment carries it already
compiled by the host (``AGENTENV_KEEPER_CODE``: marshalled, compressed, base64, ~30 KB, under the kernel's
128 KiB per string), and a one-line loader runs it when the sandbox's ``python3`` is the host's version
(``cache_tag``: marshalled code is only valid within one version); any other interpreter compiles the
bind-mounted source (``keeper_file``, the joined parts). Either way the code is the host's own, run in the
``__main__`` module as a script is. The loader takes the variable out of the environment first, so no
command the keeper starts inherits it, and ``ps`` shows a short command line.

The keeper was called the agent until issue 42, mounted at ``/.agentenv/agent.py`` (``OLD_DEST``). A CRIU image
records every mount of the sandbox it saved, and CRIU refuses to restore one whose bind mount the new sandbox's
config does not have; the process it brings back runs on with the code it had, which knows only its own path. So
a restore of images dumped before the rename (a snapshot, a paused sandbox, an E2B template, and every snapshot of
a sandbox restored from one of those) mounts the keeper where they have it (``mount_as_dumped``). Nothing else of
the old process needs the old name: its code is one ``__main__`` module that imports only the standard library
(never a module of agentenv), the loader read the file once (or ran the code from its environment) and holds no
descriptor of it, and its socket (``/dev/agentenv/agent.sock``) and wire are unchanged.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import json
import marshal
import re
import sys
import zlib
from pathlib import Path

from agentenv.config import write_atomic, write_private
from agentenv.inside import commands, files, frames, jobs, keeper, pty, tunnel, users

PARTS = (frames, users, pty, commands, jobs, files, tunnel, keeper)  # in the order they run: each uses only the names of those before it
KEEPER_DEST = "/.agentenv/keeper.py"  # where the joined keeper is bind-mounted (read-only) in every sandbox
OLD_DEST = "/.agentenv/agent.py"  # where it was before its rename (agent -> keeper): older CRIU images record it
# a mount point as CRIU's record of the mounts holds it (mountpoints-<id>.img: mnt_entry, criu/images/mnt.proto):
# field 7, a string (tag byte 7 << 3 | 2), its length in one byte, the path
_DUMPED_AT_OLD_DEST = bytes([7 << 3 | 2, len(OLD_DEST)]) + OLD_DEST.encode()
CODE_ENV = "AGENTENV_KEEPER_CODE"
LOADER = ("import os,sys;__file__={dest!r};_c=os.environ.pop({var!r},'');exec(__import__('marshal').loads("
          "__import__('zlib').decompress(__import__('binascii').a2b_base64(_c))) if _c and "
          "sys.implementation.cache_tag=={tag!r} else compile(open(__file__).read(),__file__,'exec'))")
FUTURE = "from __future__ import annotations\n"
_SIBLING_IMPORT = re.compile(r"^from agentenv\.inside\.\w+ import (\([^)]*\)|[^\n(]*)\n", re.M)


@functools.cache
def keeper_source() -> str:
    """The keeper as one module: its parts in order, their imports of each other and ``from __future__`` lines
    taken out (one goes on top)."""
    joined = []
    for part in PARTS:
        assert part.__file__ is not None
        text = Path(part.__file__).read_text()
        joined.append(f"# --- agentenv/inside/{Path(part.__file__).name} ---\n"
                      + _SIBLING_IMPORT.sub("", text.replace(FUTURE, "")))
    return FUTURE + "\n".join(joined)


def keeper_file(folder: Path) -> Path:
    """The joined keeper as a file in ``folder``, named by its content (written once, atomically), for the
    sandbox's bind mount: a snapshot's bundle keeps naming the one its keeper came from."""
    source = keeper_source()
    path = folder / f"agent-{hashlib.sha256(source.encode()).hexdigest()[:16]}.py"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        # the first restores on a fresh server run in parallel and write it at once (each its own temporary file)
        write_atomic(path, source, mode=0o644)
    return path


def keeper_command(tag: str = sys.implementation.cache_tag) -> list[str]:
    """The keeper's command line in the sandbox (``process.args`` of its OCI config), for a host whose
    interpreter is ``tag``."""
    return ["python3", "-I", "-S", "-c", LOADER.format(dest=KEEPER_DEST, var=CODE_ENV, tag=tag)]


@functools.cache
def keeper_env() -> str:
    """The variable that carries this host's keeper, compiled (``NAME=value``, for ``process.env``)."""
    code = compile(keeper_source(), KEEPER_DEST, "exec")
    return f"{CODE_ENV}={binascii.b2a_base64(zlib.compress(marshal.dumps(code), 9), newline=False).decode()}"


def dumped_dest(images: Path) -> str:
    """Where the keeper was mounted in the sandbox that a CRIU dump in ``images`` saved: ``OLD_DEST`` in images
    dumped before the rename, else ``KEEPER_DEST``. Read from CRIU's own record of the mounts, which every dump
    has (runc's and ours, with runc's record of the container or without)."""
    dumped = any(_DUMPED_AT_OLD_DEST in image.read_bytes() for image in images.glob("mountpoints-*.img"))
    return OLD_DEST if dumped else KEEPER_DEST


def mount_as_dumped(config: Path, images: Path) -> None:
    """Mount the keeper where the dump in ``images`` had it: the bundle's ``config`` (config.json) changed in
    place before a restore, if the dump was made before the rename (a new sandbox's has it at ``KEEPER_DEST``)."""
    dest = dumped_dest(images)
    if dest == KEEPER_DEST:
        return
    oci = json.loads(config.read_text())
    for m in oci["mounts"]:
        if m["destination"] == KEEPER_DEST:
            m["destination"] = dest
    write_private(config, json.dumps(oci))  # as prepare wrote it: the host's alone
