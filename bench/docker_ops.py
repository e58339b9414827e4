"""The plain Docker side of ``bench.sandbox``: the closest Docker SDK path to each operation of its table.

Docker's checkpoint-based operations (checkpoint create, fork = checkpoint + commit + create + copy the
checkpoint + start from it, pause = checkpoint --exit, restore) go through the engine's HTTP API, which the
SDK does not wrap.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import docker
import docker.errors
import requests
from docker.models.containers import Container as DockerContainer

from bench.harness import Result, Timer, recording
from bench.sandbox_common import (
    BURST,
    CPUS,
    IMAGE,
    MEM_CODE,
    MEM_MB,
    MEMORY,
    REPO_CHECK,
    REPO_EDIT,
    REPO_SETUP,
    Cleanup,
    Fixture,
    Side,
    run_burst,
    wait_until,
)

START_RETRIES = 5  # moby/moby#42900: start --checkpoint sometimes fails with "content ... already exists"


class DockerSide(Side):
    name = "docker"

    def __init__(self, client: docker.DockerClient, cleanup: Cleanup, fork_source: str) -> None:
        super().__init__(cleanup, fork_source)
        self.client, self.api = client, client.api
        self.root = Path(client.info()["DockerRootDir"])
        self.burst_size = BURST  # --docker-burst: a smaller burst where 64 docker runs take too long

    # low-level helpers: the SDK has no checkpoint calls, so they are plain requests on its session
    def engine(self, method: str, path: str, **kw: Any) -> None:
        """``method`` on the engine's versioned ``path`` (its parts URL-quoted by the caller); an error status
        raises the SDK's own ``APIError``, as its wrapped calls do."""
        url = f"{self.api.base_url}/v{self.api.api_version}{path}"
        try:
            self.api.request(method, url, timeout=self.api.timeout, **kw).raise_for_status()
        except requests.exceptions.HTTPError as e:
            raise docker.errors.create_api_error_from_http_exception(e) from e

    def checkpoint(self, cid: str, name: str, exit_: bool) -> None:
        self.engine("POST", f"/containers/{quote(cid)}/checkpoints", json={"CheckpointID": name, "Exit": exit_})

    def delete_checkpoint(self, cid: str, name: str) -> None:
        with contextlib.suppress(Exception):
            self.engine("DELETE", f"/containers/{quote(cid)}/checkpoints/{quote(name)}")

    def start_from_checkpoint(self, cid: str, name: str, m: Result) -> None:
        """Start from a checkpoint; the known 'already exists' race is retried (the time counts) and logged."""
        for attempt in range(START_RETRIES + 1):
            try:
                self.engine("POST", f"/containers/{quote(cid)}/start", params={"checkpoint": name})
                return
            except docker.errors.APIError as e:
                if "already exists" not in str(e) or attempt == START_RETRIES:
                    raise
                m.fields["retries"] = m.fields.get("retries", 0) + 1
                msg = str(e.explanation or e)
                errs = m.fields.setdefault("retry_errors", [])
                if msg not in errs and len(errs) < 3:
                    errs.append(msg)
                time.sleep(0.05 * 2**attempt)

    def place_checkpoint(self, src: str, dst: str, name: str) -> None:
        """Copy a checkpoint into another container's own folder: Docker refuses custom dirs on start.

        Each copy gets a nonce file (CRIU ignores it) so that its content digest is unique: Docker uploads
        the checkpoint into containerd's content store on start, and identical copies started close together
        collide there with "content ... already exists" (moby/moby#42900), which makes parallel forks fail.
        """
        target = self.root / "containers" / dst / "checkpoints" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.root / "containers" / src / "checkpoints" / name, target, symlinks=True)
        (target / "bench-nonce").write_text(dst)

    def running(self, cid: str) -> bool:
        return bool(self.api.inspect_container(cid)["State"]["Running"])

    def new_container(self, image: str, command: list[str]) -> str:
        host_config = self.api.create_host_config(network_mode="none", nano_cpus=int(CPUS * 1e9), mem_limit=MEMORY)
        cid: str = self.api.create_container(image, command=command, host_config=host_config,
                                             labels=self.cleanup.labels)["Id"]
        self.cleanup.containers.append(cid)
        return cid

    def run(self, command: list[str], network: str = "none") -> DockerContainer:
        c = self.client.containers.run(IMAGE, command, detach=True, network_mode=network, nano_cpus=int(CPUS * 1e9),
                                       mem_limit=MEMORY, labels=self.cleanup.labels)
        self.cleanup.containers.append(c.id)
        return c

    def commit(self, cid: str) -> str:
        res = self.api.commit(cid, conf={"Labels": self.cleanup.labels})
        iid: str = res["Id"]
        self.cleanup.images.append(iid)
        return iid

    def exec_ok(self, c: DockerContainer, cmd: str | list[str]) -> str:
        code, out = c.exec_run(cmd)
        if code != 0:
            raise RuntimeError(f"docker exec {cmd!r} exited {code}: {out.decode(errors='replace')[-500:]}")
        return str(out.decode(errors="replace"))

    def fork_child(self, src: str, image: str, command: list[str], name: str, m: Result, phases: bool) -> str:
        with Timer() as t_create:
            cid = self.new_container(image, command)
        with Timer() as t_copy:
            self.place_checkpoint(src, cid, name)
        with Timer() as t_start:
            self.start_from_checkpoint(cid, name, m)
            wait_until(lambda: self.running(cid), 60, "container restored from checkpoint", every=0.002)
        if phases:
            m.add_extra("create", t_create.s)
            m.add_extra("copy_checkpoint", t_copy.s)
            m.add_extra("start_checkpoint", t_start.s)
        return cid

    # fixtures
    def setup(self, name: str) -> Fixture:
        if name == "repo":
            repo = self.run(["sleep", "infinity"])
            self.exec_ok(repo, ["sh", "-c", REPO_SETUP])
            self.info["repo_files"] = int(self.exec_ok(repo, ["sh", "-c", "cd /testbed && git ls-files | wc -l"]))
            return Fixture(repo.id, REPO_CHECK, command=["sleep", "infinity"])
        mem = self.run(["python3", "-c", MEM_CODE])

        def rss_kb() -> int:
            out = self.exec_ok(mem, ["sh", "-c", "grep VmRSS /proc/1/status"])
            return int(out.split()[1])

        wait_until(lambda: rss_kb() >= MEM_MB * 1000, 60, "100 MB process", every=0.1)
        self.info["mem_rss_kb"] = rss_kb()
        return Fixture(mem.id, "test -d /proc/1", command=["python3", "-c", MEM_CODE])

    def teardown(self, fx: Fixture) -> None:
        self.cleanup.remove_container(self.client, fx.handle)

    # operations
    def create(self, runs: int, name: str = "create", network: str = "none") -> None:
        m = self.result(name)
        m.note = f"containers.run(detach=True, network_mode={network!r}) of 'sleep infinity' until State.Running"
        with recording(m, f"docker run ({network})"):
            self.cleanup.remove_container(self.client, self.run(["sleep", "infinity"], network).id)  # warm-up
            for _ in range(runs):
                with Timer() as t:
                    c = self.run(["sleep", "infinity"], network)
                    wait_until(functools.partial(self.running, c.id), 30, "docker run", every=0.001)
                m.add(t.s)
                self.cleanup.remove_container(self.client, c.id)

    def create_net(self, runs: int) -> None:
        self.create(runs, "create_net", network="bridge")

    def burst(self, runs: int) -> None:
        m = self.result("burst")
        m.note = f"{self.burst_size} threads at once: docker run 'sleep infinity' + docker exec 'true'"

        def one() -> None:
            self.exec_ok(self.run(["sleep", "infinity"]), "true")

        with recording(m, "docker burst"):
            run_burst(m, self.burst_size, one)
        for cid in list(self.cleanup.containers):
            self.cleanup.remove_container(self.client, cid)

    def exec(self, runs: int) -> None:
        m = self.result("exec")
        with recording(m, "docker exec"):
            c = self.run(["sleep", "infinity"])
            self.exec_ok(c, "true")
            for _ in range(runs):
                with Timer() as t:
                    self.exec_ok(c, "true")
                m.add(t.s)
            self.cleanup.remove_container(self.client, c.id)

    def fs_snapshot(self, runs: int) -> None:
        m = self.result("fs_snapshot")
        m.note = "docker commit (pauses the container) of the container with the git repo and edits"
        with recording(m, "docker commit"):
            repo = self.client.containers.get(self.fixture("repo").handle)
            for i in range(runs):
                self.exec_ok(repo, ["sh", "-c", REPO_EDIT.format(n=i)])
                with Timer() as t:
                    iid = self.commit(repo.id)
                m.add(t.s)
                self.cleanup.remove_image(self.client, iid)

    def fork1(self, runs: int) -> None:
        """checkpoint + commit + create + copy + start, and the first exec in the child (``fork1_exec``)."""
        m1, me = self.result("fork1"), self.result("fork1_exec")
        m1.note = (f"source: the {self.fork_source} container; checkpoint (leave running) + commit + create from "
                   "the committed image + copy the checkpoint into it + start --checkpoint, until running; "
                   "extra: the phases; each copy gets a nonce file against moby#42900 ('content already exists' "
                   "when identical checkpoints are started close together); a start still failing that way is "
                   f"retried up to {START_RETRIES} times, the retries counting in the time and listed under 'retries'")
        with recording(m1, "docker fork(1)"):
            fx = self.fixture("fork")
            src = fx.handle
            for i in range(runs):
                name = f"bf1-{i}-{uuid.uuid4().hex[:6]}"
                t0 = time.perf_counter()
                self.checkpoint(src, name, exit_=False)
                t1 = time.perf_counter()
                iid = self.commit(src)
                t2 = time.perf_counter()
                cid = self.fork_child(src, iid, fx.command, name, m1, phases=True)
                m1.add(time.perf_counter() - t0)
                m1.add_extra("checkpoint", t1 - t0)
                m1.add_extra("commit", t2 - t1)
                try:
                    child = self.client.containers.get(cid)
                    with Timer() as t:
                        self.exec_ok(child, "true")
                    me.add(t.s)
                    if i == 0:
                        self.exec_ok(child, ["sh", "-c", fx.check])
                except Exception as e:
                    me.fail(e)
                    raise
                finally:
                    self.cleanup.remove_container(self.client, cid)
                    self.cleanup.remove_image(self.client, iid)
                    self.delete_checkpoint(src, name)

    def fork8(self, runs: int) -> None:
        m8 = self.result("fork8")
        m8.note = "one checkpoint + one commit, then 8 x (create + copy + start --checkpoint) in 8 threads"
        with recording(m8, "docker fork(8)"):
            fx = self.fixture("fork")
            src = fx.handle
            for i in range(runs):
                name = f"bf8-{i}-{uuid.uuid4().hex[:6]}"
                kids: list[str] = []
                iid = ""
                try:
                    t0 = time.perf_counter()
                    self.checkpoint(src, name, exit_=False)
                    iid = self.commit(src)
                    with ThreadPoolExecutor(max_workers=8) as pool:
                        futures = [pool.submit(self.fork_child, src, iid, fx.command, name, m8, False)
                                   for _ in range(8)]
                    for f in futures:
                        with contextlib.suppress(Exception):
                            kids.append(f.result())
                    for f in futures:
                        f.result()  # re-raise the first failure
                    m8.add(time.perf_counter() - t0)
                finally:
                    for cid in kids:
                        self.cleanup.remove_container(self.client, cid)
                    # children whose start failed are still listed in cleanup.containers: swept at the end
                    if iid:
                        for cid in list(self.cleanup.containers):
                            with contextlib.suppress(Exception):
                                if self.api.inspect_container(cid)["Image"] == iid:
                                    self.cleanup.remove_container(self.client, cid)
                        self.cleanup.remove_image(self.client, iid)
                    self.delete_checkpoint(src, name)

    def start_child(self, image: str, command: list[str]) -> str:
        cid = self.new_container(image, command)
        self.api.start(cid)
        wait_until(lambda: self.running(cid), 60, "container started", every=0.002)
        return cid

    def fs_forks(self, op: str, n: int, runs: int) -> None:
        """The Docker way to fork the files only: commit, then ``n`` x (create from the image + start) in threads,
        until every child runs; the first exec in the one child of fork(1) is ``<op>_exec``."""
        m = self.result(op)
        m.note = f"docker commit of the {self.fork_source} container, then {n} x (create + start) until running"
        with recording(m, f"docker {op}"):
            fx = self.fixture("fork")
            for _ in range(runs):
                kids: list[str] = []
                iid = ""
                try:
                    t0 = time.perf_counter()
                    iid = self.commit(fx.handle)

                    with ThreadPoolExecutor(max_workers=n) as pool:
                        futures = [pool.submit(self.start_child, iid, fx.command) for _ in range(n)]
                    kids = [f.result() for f in futures]
                    m.add(time.perf_counter() - t0)
                    if n == 1:
                        with Timer() as t:
                            self.exec_ok(self.client.containers.get(kids[0]), "true")
                        self.result(f"{op}_exec").add(t.s)
                finally:
                    for cid in kids:
                        self.cleanup.remove_container(self.client, cid)
                    if iid:  # children whose start failed are swept by label at the end
                        with contextlib.suppress(Exception):
                            self.cleanup.remove_image(self.client, iid)

    def fork1_fs(self, runs: int) -> None:
        self.fs_forks("fork1_fs", 1, runs)

    def fork8_fs(self, runs: int) -> None:
        self.fs_forks("fork8_fs", 8, runs)

    def mem_snapshot(self, runs: int) -> None:
        m = self.result("mem_snapshot")
        m.note = f"POST /containers/{{id}}/checkpoints Exit=false, the {MEM_MB} MB python process is PID 1"
        with recording(m, "docker checkpoint create"):
            cid = self.fixture("mem").handle
            for i in range(runs):
                name = f"bm-{i}-{uuid.uuid4().hex[:6]}"
                with Timer() as t:
                    self.checkpoint(cid, name, exit_=False)
                m.add(t.s)
                self.delete_checkpoint(cid, name)

    def pause(self, runs: int) -> None:
        """checkpoint --exit until stopped, then start --checkpoint until running (``resume``)."""
        mp, mr = self.result("pause"), self.result("resume")
        mp.note = "checkpoint with Exit=true (frees the memory like agentenv's pause), until stopped"
        mr.note = "POST /containers/{id}/start?checkpoint=NAME on the same container, until running"
        with recording(mp, "docker pause (checkpoint --exit) / resume (start --checkpoint)"):
            cid = self.fixture("mem").handle
            for i in range(runs):
                name = f"bp-{i}-{uuid.uuid4().hex[:6]}"
                with Timer() as t:
                    self.checkpoint(cid, name, exit_=True)
                    wait_until(lambda: not self.running(cid), 30, "container stopped by checkpoint", every=0.002)
                mp.add(t.s)
                try:
                    with Timer() as t2:
                        self.start_from_checkpoint(cid, name, mr)
                        wait_until(lambda: self.running(cid), 60, "container restored", every=0.002)
                except Exception as e:
                    mr.fail(e)
                    raise
                mr.add(t2.s)
                self.delete_checkpoint(cid, name)

    def restore(self, runs: int) -> None:
        m = self.result("restore")
        m.note = ("create a new container from the same image + copy the checkpoint into it + start --checkpoint, "
                  "until running (warm SDK client, no interpreter start)")
        with recording(m, "docker restore into a new container"):
            src = self.fixture("mem").handle
            name = f"br-{uuid.uuid4().hex[:6]}"
            self.checkpoint(src, name, exit_=False)
            try:
                for _ in range(runs):
                    with Timer() as t:
                        cid = self.fork_child(src, IMAGE, ["python3", "-c", MEM_CODE], name, m, phases=True)
                    m.add(t.s)
                    self.cleanup.remove_container(self.client, cid)
            finally:
                self.delete_checkpoint(src, name)
