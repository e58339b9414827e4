"""Benchmarks that print figures and write them to bench/results/ (run as ``python -m bench.<name>``)."""
