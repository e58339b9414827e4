"""Benchmarks that print figures and write them to bench/results/ (run as ``python -m bench.<name>``).

One harness (``harness``: percentiles, ratios against the plain alternative in the same run, one JSON layout with
the commit and the machine's speed); the programs: ``sandbox``, ``snapshot_scale``, ``server``, ``e2b``, ``swe``,
``grading_guard``, ``policy``, ``policy_serving``, ``rollout``, ``train``.
"""
