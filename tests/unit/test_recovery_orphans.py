"""Which orphans recovery ends rather than waits for (no Docker)."""

from agentenv.sandbox.recovery import lazy_dump


def test_only_a_post_copy_dump_is_ended_by_recovery():
    assert lazy_dump(b"criu\0dump\0--tree\0123\0--leave-running\0--lazy-pages\0--address\0127.0.0.1\0")
    assert not lazy_dump(b"criu\0dump\0--tree\0123\0--leave-running\0")  # a snapshot's dump finishes on its own
    assert not lazy_dump(b"criu\0lazy-pages\0--page-server\0")  # the receiving side's daemon
    assert not lazy_dump(b"criu\0restore\0--lazy-pages\0")
    assert not lazy_dump(b"sh\0-c\0echo dump --lazy-pages\0")  # words inside one argument are not flags
