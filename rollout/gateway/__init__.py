"""The LLM gateway: unmodified agent harnesses, trained.

A harness (mini-swe-agent through litellm, an OpenAI or Anthropic SDK agent, a CLI in a sandbox) is pointed at the
gateway instead of a model provider. The gateway speaks OpenAI Chat Completions and Responses and Anthropic Messages,
streaming or not, in front of any engine that takes token ids (ours, vLLM, SGLang), and keeps each episode's calls as
the token ids the engine generated: ``rollout.gateway.export`` turns a session into ``rollout.trajectory`` records the
trainer consumes unchanged. docs/harnesses.md ("Train your harness") says what a harness user adds.

Modules, in the order a call meets them: ``app`` (routes, capability check, each API's errors and streams),
``openai_chat`` / ``responses`` / ``anthropic`` (each API read into a neutral ``messages.Call`` and answered from a
neutral ``messages.Answer``), ``sessions`` (capabilities, settings, budgets), ``turns`` (retries, budgets, the
weight-push gate, one generation), ``tape`` (token fidelity: verbatim ids, new tails, labelled branches),
``upstream`` (the engine, token ids in and out), ``export`` (a session's trajectories).
"""
