"""The file calls of a remote sandbox (``RemoteSandbox`` inherits them): read, write, stat, list, make, move and
remove a path inside the sandbox, each one request to the sandbox's file routes on its server.

They take and return what ``agentenv.Sandbox``'s do (``agentenv.api.FileInfo``) and raise the same errors; a path
is checked here as the local API checks it, and the server resolves it inside the sandbox. Apart from the rest of
the sandbox's calls because they need nothing of it but its one call to its server, ``_call``.
"""

from __future__ import annotations

from typing import Any, cast

from agentenv.api import MAX_DEPTH, FileInfo


class RemoteFiles:
    """The file system of a sandbox on a server, over the sandbox's ``_call``."""

    def _call(self, method: str, suffix: str, body: Any = None, **kw: Any) -> Any:
        """``method`` on the sandbox's route ``suffix``, the decoded reply (``RemoteSandbox`` defines it)."""
        raise NotImplementedError

    def read_file(self, path: str) -> bytes:
        return cast(bytes, self._call("GET", "/files", params={"path": _checked(path)}, idempotent=True))

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a whole file atomically, creating parent folders."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        self._call("PUT", "/files", params={"path": _checked(path), "mode": mode}, content=payload, idempotent=True)

    def stat(self, path: str) -> FileInfo:
        """What is at ``path`` (FileNotFoundError if nothing)."""
        return FileInfo.from_wire(self._call("GET", "/stat", params={"path": _checked(path)}, idempotent=True))

    def list_dir(self, path: str, depth: int = 1) -> list[FileInfo]:
        """The entries under ``path`` down to ``depth`` levels (1: its children), symlinked folders not followed."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        found = self._call("GET", "/list", params={"path": _checked(path), "depth": min(depth, MAX_DEPTH)},
                           idempotent=True)
        return [FileInfo.from_wire(f) for f in found]

    def make_dir(self, path: str) -> bool:
        """Make a folder and its parents; False if it already was one (FileExistsError if a file is there)."""
        return bool(self._call("POST", "/mkdir", {"path": _checked(path)})["made"])

    def move(self, src: str, dst: str) -> FileInfo:
        """Rename ``src`` to ``dst`` (across file systems too); the info of ``dst``."""
        return FileInfo.from_wire(self._call("POST", "/move", {"src": _checked(src), "dst": _checked(dst)}))

    def remove(self, path: str) -> None:
        """Remove a file, a symlink or a whole folder (FileNotFoundError if nothing is there)."""
        self._call("DELETE", "/files", params={"path": _checked(path)})


def _checked(path: str) -> str:
    """A path as the local API takes one (the server resolves it inside the sandbox), else ValueError."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"path must be a non-empty string, got {path!r}")
    return path
