"""The sandbox and its lifecycle: ``core`` (the ``Sandbox`` class), the calls into a running one (``calls``,
``channel``, ``jobs``), ``forking``, ``snapshotting``, ``recovery`` after a crash, the ``warm`` pool, and the
on-disk ``record``. Snapshots themselves (dump, restore, the store, export and import) are the snapshot
room's (``agentenv.snapshot``), which this one calls.

Importing any of them imports ``core`` first: it binds what the lifecycle modules call back (the warm pool's
``Sandbox.create``), so ``from agentenv.sandbox import warm`` works before ``agentenv.Sandbox`` is named (``import
agentenv`` itself loads none of this: ``agentenv.connect`` needs no host stack)."""

from agentenv.sandbox import core  # noqa: F401 - imported for what it binds (see above)
