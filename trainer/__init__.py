"""Training on trajectories: GRPO / PPO and the SFT warm start for the k3-mini policy, with expert + data
parallelism, weight sync to the policy servers, checkpoints, and metrics.

    algorithm/      the maths: GRPO advantages (Dr. GRPO: no std; leave-one-out, infra failures left out), token-level
                    PPO-clip losses with truncated importance sampling and k3 KL (losses), trajectories -> samples ->
                    micro-batches (batch), aux-loss-free MoE balancing (balance), RL health figures (health)
    distributed/    where it runs: EP + DP process groups (parallel), one rank and its typed ops (rank, on
                    policy.ranks's loop), ranks as Ray actors (ray_ranks), weight sync to the servers (sync)
    loop/           the RL loop of ``agentenv train``: the Loop (core), its parts, config (TOML), tasks, schedule
                    (bounded staleness), evaluation, services (pre-flight, the policy server), report
    train.py        Trainer: the model as served, EP + DP on torch.distributed, AdamW, step / checkpoint / resume
    sft.py          masked NLL on demonstrations, a resumable SFT run (demos.py: the scripted demonstrator)
    checkpoint.py   atomic checkpoint folders; metrics.py, trackers.py: JSONL, plots, live display, trackers
    rollouts.py     the loop's groups on the rollout workers; partial.py: partial rollouts
    cli.py          ``python -m trainer sft ...`` and ``python -m trainer plot ...``
    viewer/         the trajectory viewer: runs, filtered episodes, tokens with mask and logprob, groups (data,
                    runs), its pages and routes (web, static/): ``agentenv view RUN``, ``agentenv serve --runs DIR``

Nothing is imported here: ``import trainer.algorithm.advantages`` stays light (no torch)."""
