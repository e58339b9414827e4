"""What a sandbox stands on: the Linux machinery of the host.

System calls Python lacks (``hostcalls``), cgroups, the seccomp profile, user namespaces (``userns``), the
disk volume and its quotas (``volume``),
networking (``network``), images, admission under memory pressure, the OCI runtime (``runtime``) and the
keeper process as the host starts and knows it (``keeper_start``, ``keeper_process``). Nothing here knows a ``Sandbox``
or CRIU: dumps and restores are the snapshot room's (``agentenv.snapshot``).
"""
