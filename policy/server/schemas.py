"""Request bodies of the policy server and their checks; a bad request raises HTTPException (4xx, reason)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict

from policy.chat import ARG_BEGIN, CALL_BEGIN, FUNCTION_PREFIX, SECTION_BEGIN, validate_tools
from policy.engine import SamplingParams


class SamplingRequest(BaseModel):
    """What chat and text completions share (OpenAI's fields; unknown ones are accepted and ignored)."""

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


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    tools: Any = None
    tool_choice: Any = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]


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
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return [SamplingParams(max_tokens, req.temperature, req.top_p,
                           None if req.seed is None else req.seed + i, stop) for i in range(req.n)]


def tool_prompt(req: ChatRequest) -> tuple[list[dict[str, Any]], str]:
    """The tools to declare and the text that forces ``tool_choice`` (appended to the prompt; the answer is
    parsed with it in front); raises ValueError when ``tools`` or ``tool_choice`` is malformed."""
    tools = validate_tools(req.tools)
    choice = req.tool_choice
    if choice == "none":
        return [], ""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names a function that is not in tools: {name!r}")
        return tools, f"{SECTION_BEGIN}{CALL_BEGIN}{FUNCTION_PREFIX}{name}:0{ARG_BEGIN}"
    if choice == "required":  # the model must open a tool call; it picks the function
        if not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return tools, f"{SECTION_BEGIN}{CALL_BEGIN}{FUNCTION_PREFIX}"
    if choice not in (None, "auto"):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or a named function")
    return tools, ""
