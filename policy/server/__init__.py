"""OpenAI-compatible HTTP server for the policy (FastAPI): chat and text completions with token ids and
logprobs, streaming, weight updates, health and metrics. Every route except /health and /metrics needs
``Authorization: Bearer <token>``; bad input is answered with a 4xx and a reason.

- ``schemas``: the request bodies and their checks (sampling parameters, tools and ``tool_choice``);
- ``app``: ``create_app``, the routes, authentication and the error format;
- ``responses``: the chat and text-completion answers, whole or as stream chunks;
- ``streaming``: generations on the engine seen from asyncio, and the one server-sent-events generator
  that both completion routes stream with.

Beyond OpenAI's API (``responses`` and ``schemas`` say exactly): token ids in and out, ``weight_version``,
vLLM's ``prompt_logprobs`` and ``stop_token_ids`` request fields, ``return_routed_experts`` (the experts behind
every generated token, for routing replay), ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens served
from the prefix cache), ``response_format`` JSON schemas and forced tool calls held to their ``parameters``
by constrained decoding (``policy.grammar``), vLLM's ``/tokenize`` and ``/detokenize`` routes, and the engine's
counters (prefill tokens computed and saved, the prefix cache) in ``/metrics``.

Whether a chat answer holds tool calls or is ``malformed_tool_calls`` is decided by
``policy.chat.parse_assistant`` alone, the parser the envs use too.
"""

from policy.server.app import create_app
from policy.server.schemas import ChatRequest, CompletionRequest, SamplingRequest, UpdateWeightsRequest

__all__ = ["ChatRequest", "CompletionRequest", "SamplingRequest", "UpdateWeightsRequest", "create_app"]
