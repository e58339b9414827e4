"""How a sandbox's PID 1 starts the agent: precompiled by the host where the sandbox's Python can run it.

Every sandbox start (create, each fork child, restore of files only) waits for its agent's first answer.
Run as a script, ``agent.py`` is compiled from source each time (a script's bytecode is never cached): about
10 ms of a start, more than the interpreter takes to come up. So the agent's environment carries it already
compiled by the host (``AGENTENV_AGENT_CODE``: marshalled, compressed, base64, ~30 KB, under the kernel's
128 KiB per string), and a one-line loader runs it when the sandbox's ``python3`` is the host's version
(``cache_tag``: marshalled code is only valid within one version); any other interpreter compiles the
bind-mounted ``agent.py``, as before. Either way the code is the host's own ``agent.py``, run in the
``__main__`` module as a script is. The loader takes the variable out of the environment first, so no
command the agent starts inherits it, and ``ps`` shows a short command line.
"""

from __future__ import annotations

import binascii
import functools
import marshal
import sys
import zlib

from agentenv.inside import agent

AGENT_DEST = "/.agentenv/agent.py"  # where the host's agent.py is bind-mounted (read-only) in every sandbox
CODE_ENV = "AGENTENV_AGENT_CODE"
LOADER = ("import os,sys;__file__={dest!r};_c=os.environ.pop({var!r},'');exec(__import__('marshal').loads("
          "__import__('zlib').decompress(__import__('binascii').a2b_base64(_c))) if _c and "
          "sys.implementation.cache_tag=={tag!r} else compile(open(__file__).read(),__file__,'exec'))")


def agent_command(tag: str = sys.implementation.cache_tag) -> list[str]:
    """The agent's command line in the sandbox (``process.args`` of its OCI config), for a host whose
    interpreter is ``tag``."""
    return ["python3", "-I", "-S", "-c", LOADER.format(dest=AGENT_DEST, var=CODE_ENV, tag=tag)]


@functools.cache
def agent_env() -> str:
    """The variable that carries this host's agent, compiled (``NAME=value``, for ``process.env``)."""
    with open(agent.__file__) as f:
        code = compile(f.read(), AGENT_DEST, "exec")
    return f"{CODE_ENV}={binascii.b2a_base64(zlib.compress(marshal.dumps(code), 9), newline=False).decode()}"
