"""envd's ``process.Process`` service over a sandbox's jobs: start, connect, list, stdin, signals.

A command is a job of the sandbox's keeper (``Sandbox.start``): its output is buffered inside the sandbox
until read, so a background command whose handle never reads loses nothing and a dropped client does not
kill it; ``Connect`` replays what is still buffered and follows. The Start call's deadline
(``Connect-Timeout-Ms``, the SDK's ``timeout``) is the command's own: past it the keeper kills the process
group and the stream ends with ``deadline_exceeded``, as E2B documents. Jobs live in the keeper, PID 1 of
the sandbox, so pause/resume and fork carry every command along. A command runs as the account its request
names (envd's ``Authorization: Basic``; ``bridge.acting``): that account's uid, gid, groups and environment
from the image's /etc/passwd and /etc/group, in its home unless a cwd is given; an account the image lacks is
E2B's ``unauthenticated`` "invalid username". A Start with ``pty`` runs the command on a terminal the keeper
opens (``Sandbox.start_terminal``): its output comes as ``pty`` data, ``pty`` input is typed at it, ``Update``
resizes it, and a kill ends it as any command.
"""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_connect
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from agentenv.api import JobEnd, JobInfo, JobOutput
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b.bridge import acting, call, iterate, one_of, sandbox_of, user_named
from agentenv.server.service import Service

Event = pb.ProcessEvent


def _start(pid: int) -> Event:
    return Event(event=one_of("start", Event.StartEvent(pid=pid)))


def _data(out: JobOutput) -> Event:
    chunk = one_of(out.stream, out.data)  # "stdout", "stderr" or "pty": the DataEvent's fields
    return Event(event=one_of("data", Event.DataEvent(output=chunk)))


def _end(end: JobEnd) -> Event:
    status = "timed out" if end.timed_out else (f"exit status {end.exit_code}" if end.exit_code < 128
                                                 else f"signal: {end.exit_code - 128}")
    return Event(event=one_of("end", Event.EndEvent(exit_code=end.exit_code, exited=True, status=status,
                                                   error="command timed out" if end.timed_out else None)))


def _config(job: JobInfo) -> pb.ProcessConfig:
    """A job as the command line it was started with (Start joined cmd and args into one shell line)."""
    try:
        cmd, *args = shlex.split(job.command) or [""]
        if cmd == "exec" and args:  # a PTY's program, which Start runs by exec
            cmd, *args = args
    except ValueError:  # not a line Start made (a kernel, a job started another way)
        cmd, args = "/bin/sh", ["-c", job.command]
    return pb.ProcessConfig(cmd=cmd, args=args, envs=job.env, cwd=job.cwd)


def _size(pty: pb.PTY) -> tuple[int, int]:
    """A PTY message's size as (rows, cols); one without a size is refused, not given a default."""
    if pty.size is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "pty.size (rows and cols) is required")
    return pty.size.rows, pty.size.cols


class ProcessService(process_connect.Process):
    """The envd process service of every sandbox (the sandbox comes from the request's headers)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    async def _sandbox(self, ctx: RequestContext[Any, Any]) -> Sandbox:
        return await call(sandbox_of, self.service, ctx)

    async def _pid(self, sb: Sandbox, selector: pb.ProcessSelector | None) -> int:
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid):
                return int(pid)
            case Oneof(field="tag", value=tag):
                for job in await call(sb.jobs):
                    if job.tag == tag:
                        return job.pid
                raise ConnectError(Code.NOT_FOUND, f"no process with tag {tag!r}")
        raise ConnectError(Code.INVALID_ARGUMENT, "a process selector (pid or tag) is required")

    async def _follow(self, sb: Sandbox, pid: int, deadline_kills: bool) -> AsyncIterator[Event]:
        async for item in iterate(lambda: sb.output(pid)):
            if item is None:
                yield Event(event=one_of("keepalive", Event.KeepAlive()))
            elif isinstance(item, JobOutput):
                yield _data(item)
            else:  # past the Start call's deadline the command was killed: that is a timeout, not an exit code
                if item.timed_out and deadline_kills:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "the command ran past its timeout and was killed")
                yield _end(item)
                return

    async def start(self, request: pb.StartRequest, ctx: RequestContext[Any, Any]) -> AsyncIterator[pb.StartResponse]:
        sb = await self._sandbox(ctx)
        cfg = request.process or pb.ProcessConfig()
        if not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
        timeout_ms = ctx.timeout_ms
        calls = await call(acting, sb, user_named(ctx.request_headers))
        line, timeout = shlex.join([cfg.cmd, *cfg.args]), timeout_ms / 1000 if timeout_ms else None
        if request.pty is not None:
            # exec: the program leads the terminal's session itself, as under envd (its pid is the one returned)
            job: JobInfo = await call(calls.start_terminal, f"exec {line}", _size(request.pty), cwd=cfg.cwd or None,
                                      env=dict(cfg.envs), timeout=timeout, tag=request.tag or None)
        else:
            job = await call(calls.start, line, cwd=cfg.cwd or None, env=dict(cfg.envs), timeout=timeout,
                             stdin=bool(request.stdin), tag=request.tag or None)
        yield pb.StartResponse(event=_start(job.pid))
        async for event in self._follow(sb, job.pid, deadline_kills=True):
            yield pb.StartResponse(event=event)

    async def connect(self, request: pb.ConnectRequest,
                      ctx: RequestContext[Any, Any]) -> AsyncIterator[pb.ConnectResponse]:
        sb = await self._sandbox(ctx)
        pid = await self._pid(sb, request.process)
        if not any(j.pid == pid for j in await call(sb.jobs)):
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
        yield pb.ConnectResponse(event=_start(pid))
        async for event in self._follow(sb, pid, deadline_kills=False):
            yield pb.ConnectResponse(event=event)

    async def list(self, request: pb.ListRequest, ctx: RequestContext[Any, Any]) -> pb.ListResponse:
        sb = await self._sandbox(ctx)
        jobs = [j for j in await call(sb.jobs) if j.exit_code is None]
        return pb.ListResponse(processes=[pb.ProcessInfo(pid=j.pid, tag=j.tag, config=_config(j)) for j in jobs])

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext[Any, Any]) -> pb.UpdateResponse:
        if request.pty is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "an update names the pty's new size (pty.size)")
        sb = await self._sandbox(ctx)
        await call(sb.resize, await self._pid(sb, request.process), _size(request.pty))
        return pb.UpdateResponse()

    async def send_input(self, request: pb.SendInputRequest, ctx: RequestContext[Any, Any]) -> pb.SendInputResponse:
        sb = await self._sandbox(ctx)
        await self._write(sb, await self._pid(sb, request.process), request.input)
        return pb.SendInputResponse()

    async def _write(self, sb: Sandbox, pid: int, given: pb.ProcessInput | None) -> None:
        match given.input if given is not None else None:
            case Oneof(field="stdin" | "pty", value=data):  # a terminal's input end is its job's stdin
                await call(sb.send_input, pid, bytes(data))

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest],
                           ctx: RequestContext[Any, Any]) -> pb.StreamInputResponse:
        sb = await self._sandbox(ctx)
        pid: int | None = None
        async for message in request:
            event = message.event.value if message.event is not None else None
            if isinstance(event, pb.StreamInputRequest.StartEvent):
                pid = await self._pid(sb, event.process)
            elif isinstance(event, pb.StreamInputRequest.DataEvent):
                if pid is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "the stream must start with a start event")
                await self._write(sb, pid, event.input)
        return pb.StreamInputResponse()

    async def send_signal(self, request: pb.SendSignalRequest,
                          ctx: RequestContext[Any, Any]) -> pb.SendSignalResponse:
        sb = await self._sandbox(ctx)
        signal = request.signal.value if request.signal else 0
        if signal not in (9, 15):
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal}")
        await call(sb.signal, await self._pid(sb, request.process), signal)
        return pb.SendSignalResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest,
                          ctx: RequestContext[Any, Any]) -> pb.CloseStdinResponse:
        sb = await self._sandbox(ctx)
        await call(sb.close_input, await self._pid(sb, request.process))
        return pb.CloseStdinResponse()
