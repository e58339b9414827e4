"""Request bodies of the policy server and their checks; a bad request raises HTTPException (4xx, reason)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict

from policy.chat import Piece, tool_choice_pieces, validate_tools
from policy.engine import SamplingParams
from policy.grammar import GrammarUnavailable, json_schema_grammar, required_tool_grammar, tool_call_grammar


class SamplingRequest(BaseModel):
    """What chat and text completions share (OpenAI's fields; unknown ones are accepted and ignored).

    Beyond OpenAI, as vLLM names them: ``stop_token_ids``; ``prompt_logprobs`` (k: the logprob of every prompt
    token after the first, with k top alternatives; returned as ``prompt_logprobs``, ``None`` first);
    ``return_token_ids`` (accepted: token ids always come back). Ours: ``return_routed_experts`` (each choice
    gets ``routed_experts[token][moe_layer][k]``, the answer ``prompt_routed_experts``, see ``responses``).
    """

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    return_routed_experts: bool = False
    return_token_ids: bool | None = None
    response_format: dict[str, Any] | None = None


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    tools: Any = None
    tool_choice: Any = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a text ``prompt``, or chat ``messages`` (and ``tools``) rendered with K3's template."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: Any = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class UpdateWeightsRequest(BaseModel):
    path: str
    mode: str = "drain"


def bad(msg: str, code: int = 400) -> HTTPException:
    return HTTPException(code, detail=msg)


def sampling_params(req: SamplingRequest, model_name: str, prompt_len: int, max_context: int) -> list[SamplingParams]:
    """One SamplingParams per requested choice (seeds ``seed``, ``seed + 1``, ...)."""
    if req.model != model_name:
        raise bad(f"unknown model {req.model!r}; this server serves {model_name!r}", 404)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = 256 if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise bad("max_tokens must be at least 1")
    if prompt_len >= max_context:
        raise bad(f"the prompt has {prompt_len} tokens but the context is {max_context}")
    if not 1 <= req.n <= 16:
        raise bad("n must be between 1 and 16")
    if req.temperature < 0 or not 0 < req.top_p <= 1:
        raise bad("temperature must be >= 0 and top_p in (0, 1]")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= 20:
        raise bad("prompt_logprobs must be between 0 and 20")
    if req.logprobs is not None and not isinstance(req.logprobs, bool) and not 0 <= req.logprobs <= 20:
        raise bad("logprobs must be between 0 and 20")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    # only the first choice scores the prompt: the others then fork its state instead of prefilling again
    return [SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                           seed=None if req.seed is None else req.seed + i, stop=stop,
                           stop_token_ids=list(req.stop_token_ids or []),
                           prompt_logprobs=req.prompt_logprobs if i == 0 else None,
                           return_routed_experts=req.return_routed_experts) for i in range(req.n)]


def response_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar for OpenAI's ``response_format`` (``text``, ``json_object`` or ``json_schema``); raises
    ValueError when it is malformed or structured outputs are unavailable."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema' object")
        return json_schema_grammar(spec.get("schema") or {"type": "object"})
    raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")


def tool_grammar(tools: list[dict[str, Any]], choice: Any) -> str | None:
    """The grammar that holds a forced tool call's arguments to the function's declared ``parameters``
    (``tool_choice`` naming a function, or ``required``: one of the declared functions); None otherwise or
    when llguidance is missing (the call is then generated unconstrained)."""
    try:
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            fn = next(t["function"] for t in tools if t["function"]["name"] == name)
            return tool_call_grammar(fn.get("parameters"))
        if choice == "required" and tools:
            return required_tool_grammar([(t["function"]["name"], t["function"].get("parameters")) for t in tools])
    except GrammarUnavailable:
        return None
    return None


def tool_prompt(req: ChatRequest) -> tuple[list[dict[str, Any]], list[Piece]]:
    """The tools to declare and the pieces that force ``tool_choice`` (``policy.chat.tool_choice_pieces``)."""
    return tool_choice_pieces(validate_tools(req.tools), req.tool_choice)
