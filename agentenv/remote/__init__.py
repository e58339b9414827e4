"""The remote side: ``client`` (sandboxes on an ``agentenv serve`` server, ``agentenv.connect``), ``pool``
(``agentenv.Pool``, many servers) and what they need; what both ends put on the wire is ``agentenv.wire``. Loaded on
first use; the client and the pool never import the host or the sandbox rooms (``transfer``, which the receiving
server runs, does)."""
