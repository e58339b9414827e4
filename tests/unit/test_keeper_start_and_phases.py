"""The keeper's precompiled start (``agentenv.host.keeper_start``) and the phase timer (``agentenv.phases``)."""

from __future__ import annotations

import ast
import binascii
import json
import marshal
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

from agentenv import phases
from agentenv.host.keeper_start import (
    CODE_ENV,
    KEEPER_DEST,
    LOADER,
    OLD_DEST,
    PARTS,
    dumped_dest,
    keeper_command,
    keeper_env,
    keeper_file,
    keeper_source,
    mount_as_dumped,
)

PROBE = "import os, sys\nprint(sys.argv[1:], __name__, __file__.endswith('keeper.py'), os.environ.get({var!r}))\n"


def run_loader(tmp_path: Path, tag: str, compiled: str, on_disk: str) -> str:
    """Run the loader as a sandbox's python3 would: ``compiled`` precompiled for the interpreter ``tag`` in the
    environment, ``on_disk`` in the bind-mounted file."""
    dest = tmp_path / "keeper.py"
    dest.write_text(on_disk)
    blob = binascii.b2a_base64(zlib.compress(marshal.dumps(compile(compiled, str(dest), "exec"))),
                               newline=False).decode()
    src = LOADER.format(dest=str(dest), var=CODE_ENV, tag=tag)
    return subprocess.run([sys.executable, "-I", "-S", "-c", src], capture_output=True, text=True, check=True,
                          env={**os.environ, CODE_ENV: blob}).stdout


def test_the_loader_runs_the_precompiled_keeper_where_the_python_matches(tmp_path: Path) -> None:
    out = run_loader(tmp_path, sys.implementation.cache_tag, "print('compiled'); " + PROBE.format(var=CODE_ENV),
                     "print('source')")
    assert out == "compiled\n[] __main__ True None\n"  # run as the main module; the variable is gone


def test_another_python_compiles_the_mounted_keeper_instead(tmp_path: Path) -> None:
    out = run_loader(tmp_path, "cpython-00", "print('compiled')", "print('source'); " + PROBE.format(var=CODE_ENV))
    assert out == "source\n[] __main__ True None\n"


def test_the_command_is_short_and_the_environment_carries_this_hosts_keeper() -> None:
    args = keeper_command()
    assert args[:4] == ["python3", "-I", "-S", "-c"] and KEEPER_DEST in args[4] and len(args[4]) < 400
    name, _, blob = keeper_env().partition("=")
    assert name == CODE_ENV and len(keeper_env().encode()) < 128 << 10  # the kernel's limit on one string
    code = marshal.loads(zlib.decompress(binascii.a2b_base64(blob)))
    assert code.co_filename == KEEPER_DEST
    assert code.co_consts == compile(keeper_source(), KEEPER_DEST, "exec").co_consts


def _defined(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level, apart from its imports (and the ``TYPE_CHECKING`` flag)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names - {"TYPE_CHECKING"}


def test_the_parts_join_into_one_module_without_a_name_defined_twice() -> None:
    trees = {part.__name__: ast.parse(Path(str(part.__file__)).read_text()) for part in PARTS}
    seen: dict[str, str] = {}
    for name, tree in trees.items():
        for defined in _defined(tree):
            assert defined not in seen, f"{defined} is defined in {seen.get(defined)} and {name}: joined, one wins"
            seen[defined] = name
    joined = ast.parse(keeper_source())
    project = [n for n in ast.walk(joined) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("agentenv")]
    assert not project, "the joined keeper still imports a part"
    assert _defined(joined) == set(seen)


def test_each_part_uses_only_names_of_the_parts_before_it() -> None:
    """The order of PARTS is the order the sandbox runs them in: a part imports only from earlier ones."""
    for i, part in enumerate(PARTS):
        tree = ast.parse(Path(str(part.__file__)).read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("agentenv"):
                assert node.module in {p.__name__ for p in PARTS[:i]}, f"{part.__name__} imports {node.module}"


def test_the_keeper_file_is_the_joined_source_named_by_its_content(tmp_path: Path) -> None:
    path = keeper_file(tmp_path)
    assert path.read_text() == keeper_source() and keeper_file(tmp_path) == path
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def mount_entry(point: str, root: str = "/var/lib/agentenv/agents/agent-0123456789abcdef.py") -> bytes:
    """A bind mount's entry as CRIU's mountpoints image holds it (mnt.proto: 6 root, 7 mountpoint, 8 source)."""
    return b"".join(bytes([field << 3 | 2, len(v)]) + v.encode() for field, v in ((6, root), (7, point), (8, "none")))


def test_a_restore_mounts_the_keeper_where_the_dump_had_it(tmp_path: Path) -> None:
    """Images dumped before the rename name OLD_DEST as a mount point: the config moves the keeper's mount there.
    The same path as another field (a bind mount's root), or a longer one, is not that mount point."""
    images, config = tmp_path / "criu", tmp_path / "config.json"
    images.mkdir()
    mounts = [{"destination": "/proc", "type": "proc"}, {"destination": KEEPER_DEST, "type": "bind", "source": "/k"}]
    config.write_text(json.dumps({"mounts": mounts}))
    (images / "mountpoints-13.img").write_bytes(b"\x54\xd5\x22\x00" + mount_entry(KEEPER_DEST)
                                                + mount_entry("/etc/resolv.conf", root=OLD_DEST)
                                                + mount_entry(OLD_DEST + "c"))
    assert dumped_dest(images) == KEEPER_DEST
    mount_as_dumped(config, images)
    assert json.loads(config.read_text())["mounts"] == mounts  # untouched
    (images / "mountpoints-13.img").write_bytes(b"\x54\xd5\x22\x00" + mount_entry(OLD_DEST))
    assert dumped_dest(images) == OLD_DEST
    mount_as_dumped(config, images)
    assert json.loads(config.read_text())["mounts"] == [mounts[0], {**mounts[1], "destination": OLD_DEST}]
    assert config.stat().st_mode & 0o777 == 0o600
def _wait(name: str, seconds: float) -> None:
    with phases.phase(name):
        time.sleep(seconds)


def test_phases_are_timed_only_while_recorded_and_from_every_thread() -> None:
    _wait("before", 0)
    with phases.recording() as found:
        _wait("a", 0.01)
        threads = [threading.Thread(target=_wait, args=("b", 0.05)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    _wait("after", 0)
    assert sorted(p.name for p in found) == ["a", "b", "b", "b"]
    totals, spans = phases.totals(found), phases.spans(found)
    assert totals["a"] == spans["a"] >= 0.01
    assert totals["b"] >= 0.15 and spans["b"] < totals["b"]  # three at once: the sum is over the wall time


def test_a_noted_step_is_recorded_with_its_own_duration_only_while_recorded() -> None:
    phases.note("outside", 1.0)
    with phases.recording() as found:
        phases.note("criu: memdump", 0.25)
    assert [(p.name, p.seconds) for p in found] == [("criu: memdump", 0.25)]
    assert phases.spans(found)["criu: memdump"] == phases.totals(found)["criu: memdump"] == 0.25
