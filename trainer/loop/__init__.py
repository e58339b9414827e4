"""The RL loop of ``agentenv train`` (``core.Loop``): warm start, GRPO iterations with bounded staleness and partial
rollouts, held-out evaluation, one SWE iteration, and what a run leaves in ``runs/<name>/``. Its modules: ``core``
(the ``Loop``), ``parts`` (the parts built from the settings), ``config`` (the run's settings, read by
``typed_toml``), ``tasks`` (the task sources), ``schedule`` (bounded staleness), ``evaluation`` (held-out
evaluation, the SWE iteration), ``services`` (the pre-flight, the policy server) and ``report`` (the summary).

A run, in order (``Loop.run``)::

    pre-flight (services.py)            every part reachable, before anything starts
    SFT warm start (trainer/sft.py)     scripted demonstrations through the real env path -> run_sft -> weights
    trainer + policy server (parts.py)  Trainer(weights) in this process; `agentenv policy serve --ep 2` started
                                        with the same weights (or an existing endpoint), health-waited, checked
    rollout workers (trainer/loop/rollouts.py)  a local Ray (or an existing cluster) with LoopWorkers; 0: in-process
    eval before RL (evaluation.py)      held-out tasks (tasks.py), greedy unless eval.temperature
    iterations                          rollouts -> staleness filter -> rl_batch -> Trainer.step -> WeightSync.push
                                        -> checkpoint -> metrics (-> eval every N)
    eval after RL, SWE iteration        the same path on SWE-v0 tasks: a group forked from one state, SWE grading
    summary (report.py)                 table, summary.json, reward.png, metrics.png

**Bounded staleness** (``rl.max_staleness = k``, schedule.py). ``k = 0`` is synchronous and on-policy: an
iteration's rollouts run under the current weights, then the step trains on them, strictly alternating. With
``k >= 1`` a producer task collects batches ahead of the trainer — the batch of step ``t + 1`` (up to ``t + k``) is played while step ``t``
trains (the training step and the weight push run in a thread) — and puts them on a queue; each trajectory's
staleness is the current weight version minus the version of its oldest turn, and a trajectory more than ``k``
versions old (plus the versions that passed while it was paused, trainer/loop/partial.py) is dropped and counted
(``staleness/dropped``), as AReaL and prime-rl do. Versions are the policy server's: each push bumps it, and every
turn records the version that generated it; for servers that report none (vLLM, SGLang) the loop's own count of
pushes is stamped on each turn instead (trainer/loop/rollouts.py).

**Partial rollouts** (``rl.partial_rollouts``, trainer/loop/rollouts.py). An iteration launches ``groups_per_iteration
+ extra_groups`` groups (groups paused earlier first) and its rollouts end as soon as ``groups_per_iteration`` are
complete: the episodes still running are paused after their current turn to the snapshot store and resumed in the
next iteration under the new weights, instead of holding the iteration back or being thrown away. A resumed
episode's turns keep their own weight versions; its staleness bound grows by the versions pushed while it was
paused; one paused more than ``max_resumes`` times is dropped (counted). Paused groups and the task cursor are part
of a checkpoint (trainer/loop/partial.py).

Everything a run writes, under ``out_dir/name``: ``config.toml`` (the effective settings), ``demos/`` and ``sft/``
(the warm start: demonstrations, checkpoints, metrics, ``weights``, a Kimi checkpoint folder), ``trajectories/`` (every episode
of every phase as msgpack shards, ``metadata.phase`` = train / eval / swe), ``checkpoints/`` (trainer state per
iteration; ``--resume`` continues from the newest), ``weights/`` (the pushed checkpoint folders), ``metrics.jsonl``,
``reward.png``, ``metrics.png``, ``rl_health.png`` (trainer/algorithm/health.py), ``summary.json``,
``policy-server.log``.

Nothing is imported here.
"""
