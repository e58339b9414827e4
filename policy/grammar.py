"""Constrained decoding with llguidance (PyPI ``llguidance``): JSON-schema outputs and tool-call arguments.

llguidance builds its token trie straight from our ``tokenizers`` JSON (``LLTokenizer``), compiles a JSON schema
or a Lark grammar (with K3's special tokens as terminals), and gives the set of allowed next tokens at each
step; the engine masks the logits with it before sampling and feeds it the sampled token. When the grammar is
complete only the end-of-turn token (``<|im_end|>``) is allowed, so a constrained answer ends by itself.

- ``json_schema_grammar(schema)``: the whole answer is one JSON value valid under ``schema``
  (``response_format: {"type": "json_schema", ...}`` or ``{"type": "json_object"}``);
- ``tool_call_grammar(parameters)``: JSON arguments valid under a function's ``parameters`` then the ends of the
  JSON block, the call and the section, ``<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>``
  (``tool_choice`` naming a function: the prompt already ends with the call's header, see
  ``policy.chat.tool_choice_pieces``); ``required_tool_grammar(functions)`` the same for ``tool_choice:
  "required"`` (the prompt ends with ``<|open|>tools<|sep|><|open|>call tool="``), the model choosing which
  declared function to call.

JSON is written compactly (``", "`` and ``": "`` separators, no free whitespace): a model with no training
cannot run on with blanks, and valid JSON always comes out when ``max_tokens`` leaves room for it.
The logprob reported for a constrained token is under the masked distribution: the one it was sampled from.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import torch

from policy.tokenizer import K3Tokenizer
from policy.tool_calls import CLOSE, OPEN, SEP

# After the arguments: the ends of the JSON block, the call and the section (control tokens as Lark terminals)
_ENDS = " ".join(f'{CLOSE} "{tag}" {SEP}' for tag in ("json", "call", "tools"))
_JSON_OPEN = " ".join([OPEN, json.dumps('json type="object"'), SEP])
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarUnavailable(ValueError):
    """Structured outputs were asked for but llguidance is not installed."""


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise GrammarUnavailable("structured outputs need llguidance (pip install -e '.[policy]' in the checkout)") from e
    return llguidance


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    return {**schema, "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """A grammar for one JSON value valid under ``schema``."""
    return str(_llg().LLMatcher.grammar_from_json_schema(_styled(schema)))


def tool_call_grammar(parameters: dict[str, Any] | None) -> str:
    """A grammar for a tool call's JSON arguments (under ``parameters``; any object when None) and the end of
    the call and of the section."""
    schema = parameters if parameters is not None else {"type": "object"}
    lark = f"start: args {_ENDS}\nargs: %json {json.dumps(_styled(schema))}"
    return str(_llg().LLMatcher.grammar_from_lark(lark))


def required_tool_grammar(functions: list[tuple[str, dict[str, Any] | None]]) -> str:
    """For ``tool_choice: "required"`` (the prompt ends with ``<|open|>tools<|sep|><|open|>call tool="``): one of
    the declared ``(name, parameters)`` functions, its index 0, and arguments valid under its parameters."""
    rules = []
    for i, (name, params) in enumerate(functions):
        schema = params if params is not None else {"type": "object"}
        head = json.dumps(f'{name}" index="0"')   # the prompt wrote ``call tool="``
        rules.append(f"call{i}: {head} {SEP} {_JSON_OPEN} args{i} {_ENDS}\n"
                     f"args{i}: %json {json.dumps(_styled(schema))}")
    lark = "start: " + " | ".join(f"call{i}" for i in range(len(functions))) + "\n" + "\n".join(rules)
    return str(_llg().LLMatcher.grammar_from_lark(lark))


@lru_cache(maxsize=4)
def _ll_tokenizer(tok_json: str, eos: int) -> Any:
    return _llg().LLTokenizer(tok_json, eos_token=eos)


def ll_tokenizer(tokenizer: K3Tokenizer) -> Any:
    """llguidance's view of our tokenizer (built once per tokenizer)."""
    return _ll_tokenizer(tokenizer.tok.to_str(), tokenizer.eos_id)


def check_grammar(tokenizer: K3Tokenizer, grammar: str) -> None:
    """Raise ValueError with llguidance's reason when ``grammar`` does not compile."""
    err = _llg().LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    if err:
        raise ValueError(f"invalid grammar or schema: {err}")


class Constraint:
    """One sequence's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, tokenizer: K3Tokenizer, grammar: str) -> None:
        check_grammar(tokenizer, grammar)
        self.matcher = _llg().LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid grammar or schema: {self.matcher.get_error()}")

    def allowed(self, vocab: int) -> torch.Tensor:
        """Boolean (vocab,) mask of the tokens the grammar allows next."""
        bias = self.matcher.compute_logit_bias()
        mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8) > 0
        if mask.shape[0] >= vocab:
            return mask[:vocab]
        return torch.cat([mask, torch.zeros(vocab - mask.shape[0], dtype=torch.bool)])

    def mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``logits`` with disallowed tokens at -inf (a new tensor), or None when nothing is allowed."""
        if self.matcher.is_error():
            return None
        allowed = self.allowed(logits.shape[-1])
        if not bool(allowed.any()):
            return None
        return logits.float().masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    def error(self) -> str:
        return str(self.matcher.get_error())
