"""SWE task sets: pinned libraries, mutation specs, builder, validator; the shipped set and your own.

See ``envs.tasks.build`` for the pipeline and ``agentenv tasks --help`` for the commands.
``images``, ``search``, ``build`` and ``validate`` take ``--libraries FILE``, and ``images`` and
``validate`` take ``--tasks FILE``, for a set you bring (README, "Bring your own tasks").
"""
