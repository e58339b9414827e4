"""Training on trajectories: GRPO / PPO and the SFT warm start for the k3-mini policy, with expert + data
parallelism, weight sync to the policy servers, checkpoints, and metrics.

    advantages.py   GRPO group-normalised advantages (Dr. GRPO: no std; leave-one-out), infra failures left out
    losses.py       token-level PPO-clip (eps_low / eps_high), truncated importance sampling, k3 KL, entropy
    batch.py        trajectories -> samples -> micro-batches by token budget (masks, logprobs, routing replay)
    sft.py          masked NLL on demonstrations, a resumable SFT run
    health.py       RL health figures of a step (ratio / TIS extremes, advantages, malformed calls, replay coverage)
    balance.py      aux-loss-free MoE balancing: the router bias moved toward balance after each step
    train.py        Trainer: the model as served, EP + DP on torch.distributed, AdamW, step / checkpoint / resume
    sync.py         weight sync: atomic safetensors, then /update_weights (ours) or SGLang's / vLLM's reload
    metrics.py      per-iteration JSONL, PNG plots, a rich live display, optional TensorBoard
    cli.py          ``python -m trainer sft ...`` and ``python -m trainer plot ...``
    viewer/         the trajectory viewer: runs, filtered episodes, tokens with mask and logprob, groups (data,
                    runs), its pages and routes (web, static/): ``agentenv view RUN``, ``agentenv serve --runs DIR``

The RL loop (``agentenv train``): ``config`` (TOML), ``tasks``, ``rollouts`` and ``partial`` (groups, partial
rollouts), ``services`` (pre-flight, the policy server), ``loop``, ``evaluation``, ``schedule`` (bounded staleness),
``parallel`` and ``rank`` (process groups, one rank), ``report``, ``demos``.

Nothing is imported here: ``import trainer.advantages`` stays light (no torch)."""
