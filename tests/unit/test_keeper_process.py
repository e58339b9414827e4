"""``KeeperProcess`` pins a sandbox's keeper by pidfd; a refused pin must not close a descriptor twice."""

from __future__ import annotations

import gc
import os

import pytest

from agentenv.host.keeper_process import KeeperProcess


def test_a_refused_pin_never_closes_another_files_descriptor() -> None:
    """Once, a pin refused (the keeper already gone) closed its pidfd, and its ``__del__`` closed the same number
    again later: by then another thread's file (a sandbox's lock), which then failed with EBADF."""
    refused: list[BaseException] = []
    try:
        KeeperProcess(os.getpid(), None, "/agentenv/not-this-process")
    except ProcessLookupError as e:
        refused.append(e)  # its traceback keeps the half-made pin alive, as a thread's frame can
    fd = os.open("/dev/null", os.O_RDONLY)  # takes the number the refused pin freed
    try:
        refused.clear()
        gc.collect()  # the pin goes now
        os.fstat(fd)  # EBADF if its __del__ closed the number again
    finally:
        os.close(fd)


def test_a_pin_that_could_not_open_a_pidfd_is_quiet_when_collected() -> None:
    with pytest.raises(ProcessLookupError):
        KeeperProcess(2**22 + 12345, None, "/agentenv/x")  # no such pid: pidfd_open fails
    gc.collect()
