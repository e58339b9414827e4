"""OpenAI-compatible HTTP server for the policy (FastAPI): chat and text completions with token ids and
logprobs, streaming, weight updates, health and metrics. Every route except /health and /metrics needs
``Authorization: Bearer <token>``; bad input is answered with a 4xx and a reason.

- ``schemas``: the request bodies and their checks (sampling parameters, tools and ``tool_choice``);
- ``app``: ``create_app``, the routes, authentication and the error format;
- ``responses``: the chat and text-completion answers, whole or as stream chunks;
- ``streaming``: generations on the engine seen from asyncio, and the one server-sent-events generator
  that both completion routes stream with.

Whether a chat answer holds tool calls or is ``malformed_tool_calls`` is decided by
``policy.chat.parse_assistant`` alone, the parser the envs use too.
"""

from policy.server.app import create_app
from policy.server.schemas import ChatRequest, CompletionRequest, SamplingRequest, UpdateWeightsRequest

__all__ = ["ChatRequest", "CompletionRequest", "SamplingRequest", "UpdateWeightsRequest", "create_app"]
