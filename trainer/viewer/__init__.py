"""The trajectory viewer, in one place: ``runs`` (the runs under a folder, found by listing and loaded from their
own files), ``data`` (what a page shows of a run: episodes, groups, searches, metrics), ``web`` (the pages and
routes, ``agentenv view RUN`` and ``agentenv serve --runs DIR``) and ``static/`` (its HTML, script and style)."""
