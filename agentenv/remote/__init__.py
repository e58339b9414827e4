"""The remote side: ``client`` (sandboxes on an ``agentenv serve`` server, ``agentenv.connect``), ``pool``
(``agentenv.Pool``, many servers) and ``wire`` (what both ends put on the wire). Loaded on first use."""
