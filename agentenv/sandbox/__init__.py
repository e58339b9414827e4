"""The sandbox and its lifecycle: ``core`` (the ``Sandbox`` class), the calls into a running one (``calls``,
``channel``, ``jobs``), ``forking``, ``snapshotting``, ``recovery`` after a crash, the ``warm`` pool, and the
on-disk ``record`` and snapshot ``store``."""
