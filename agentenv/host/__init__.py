"""What a sandbox stands on: the Linux machinery of the host.

System calls Python lacks (``hostcalls``), cgroups, the seccomp profile, user namespaces (``userns``), the
disk volume and its quotas (``volume``), CRIU checkpoints and lazy page restores (``criu``, ``lazy_pages``),
networking (``network``), images, admission under memory pressure, the OCI runtime (``runtime``) and the
keeper process as the host starts and knows it (``keeper_start``, ``keeper_process``). Nothing here knows a ``Sandbox``.
"""
