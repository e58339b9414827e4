"""The remote side: ``client`` (sandboxes on an ``agentenv serve`` server, ``agentenv.connect``), ``pool``
(``agentenv.Pool``, many servers) and what they need; what both ends put on the wire is ``agentenv.wire``. Loaded on
first use; nothing here imports the host or the sandbox rooms (a server's pull of a snapshot from another is the
server's own: ``agentenv.server.pull``)."""
