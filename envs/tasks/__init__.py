"""The SWE task set built from real libraries: pinned libraries, mutation specs, builder, validator.

See ``envs.tasks.build`` for the pipeline and ``python -m envs.tasks --help`` for the commands.
"""
