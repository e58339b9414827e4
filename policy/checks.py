"""The checks of ``agentenv policy verify`` (``verify.py``'s module doc lists them): what each sends to the
endpoint, the way the rollout loop does (``policy.client``), and how it compares the answer with our own K3 code
(``policy.chat``, the tokenizer) and schemas (``policy.jsonschema``). Each ends in a ``Check``: PASS, FAIL or SKIP,
always with a reason. Apart from ``verify.py``, which runs them in order and reports, so that a check reads with the
conversation, tools and schemas it sends.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from policy.chat import GENERATION_PROMPT, IM_END, parse_assistant
from policy.client import Completion, PolicyBadRequest, PolicyClient, PolicyError, error_reason
from policy.jsonschema import schema_errors
from policy.tokenizer import K3Tokenizer

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}}, "required": []}}}]
# multi-turn, with tool calls (two in one turn), tool results, reasoning and a final answer
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant. Use tools when they help."},
    {"role": "user", "content": "What's the weather in Paris and in Oslo? Then run the tests."},
    {"role": "assistant", "content": "Let me check both cities.", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "functions.get_weather:1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "4°C, rain"},
    {"role": "assistant", "reasoning_content": "Both answered; now the tests.", "content": "", "tool_calls": [
        {"id": "functions.run_tests:2", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "functions.run_tests:2", "content": "3 passed in 0.12s"},
    {"role": "assistant", "content": "Paris: 18°C and sunny. Oslo: 4°C with rain. All 3 tests pass."},
    {"role": "user", "content": "Thanks! And in Rome?"},
]
ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"], "additionalProperties": False}
# Sampling parameters outside the ranges the model card (and the OpenAI API) allows: each must be refused.
CARD_VIOLATIONS: list[tuple[str, dict[str, Any]]] = [
    ("temperature < 0", {"temperature": -0.5}), ("top_p = 0", {"top_p": 0.0}), ("top_p > 1", {"top_p": 1.5}),
    ("n = 0", {"n": 0}), ("max_tokens = 0", {"max_tokens": 0}),
]


@dataclass
class Check:
    name: str
    status: str
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


class Checks:
    """The checks, each a method that talks to the endpoint through ``client`` and ends in a ``Check``."""

    def __init__(self, client: PolicyClient, tokenizer: K3Tokenizer, tolerance: float) -> None:
        self.client, self.tok, self.tolerance = client, tokenizer, tolerance
        self.max_model_len: int | None = None
        self.same_tokenizer = False
        self.prompt = tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about unit tests."}])

    async def models(self) -> Check:
        listed = await self.client.models()
        ids = [str(m.get("id")) for m in listed]
        if not ids:
            return Check("models", FAIL, "/v1/models lists no model")
        if self.client.model is not None and self.client.model not in ids:
            return Check("models", FAIL, f"{self.client.model!r} is not listed (listed: {ids})", {"models": ids})
        self.client.model = self.client.model or ids[0]
        entry = listed[ids.index(self.client.model)]
        self.max_model_len = entry.get("max_model_len") if isinstance(entry.get("max_model_len"), int) else None
        return Check("models", PASS, f"serves {self.client.model!r}" + (
            f" (context {self.max_model_len})" if self.max_model_len else ""), {"models": ids})

    async def token_ids(self) -> Check:
        c = await self.client.complete(self.prompt, max_tokens=8, temperature=1.0, seed=1)
        s = c.samples[0]
        problems = []
        if not s.token_ids:
            problems.append("no output token ids")
        if s.logprobs is None or len(s.logprobs) != len(s.token_ids):
            problems.append(f"{0 if s.logprobs is None else len(s.logprobs)} logprobs for {len(s.token_ids)} tokens")
        elif not all(math.isfinite(x) and x <= 1e-6 for x in s.logprobs):
            problems.append("logprobs are not finite log-probabilities")
        if c.prompt_ids is not None and c.prompt_ids != self.prompt:
            problems.append("the echoed prompt_token_ids differ from the ids sent")
        notes = [] if c.weight_version is not None else ["no weight_version in the answer"]
        if problems:
            return Check("token_ids", FAIL, "; ".join(problems))
        return Check("token_ids", PASS, f"{len(s.token_ids)} token ids with logprobs" +
                     (f" ({'; '.join(notes)})" if notes else ""), {"weight_version": c.weight_version})

    async def greedy(self) -> Check:
        a = await self.client.complete(self.prompt, max_tokens=12, temperature=0)
        b = await self.client.complete(self.prompt, max_tokens=12, temperature=0)
        n = await self.client.complete(self.prompt, max_tokens=12, temperature=0, n=2)
        runs = [a.samples[0].token_ids, b.samples[0].token_ids] + [s.token_ids for s in n.samples]
        if all(r == runs[0] for r in runs):
            return Check("greedy_determinism", PASS, f"{len(runs)} greedy runs (one with n=2) gave the same "
                         f"{len(runs[0])} tokens")
        return Check("greedy_determinism", FAIL, "greedy runs differ", {"runs": runs})

    async def chat_template(self) -> Check:
        expected = self.tok.encode_chat(CONVERSATION, TOOLS)
        sources: dict[str, list[int]] = {}
        notes = []
        with contextlib.suppress(PolicyError):
            sources["/tokenize"] = await self.client.tokenize(messages=CONVERSATION, tools=TOOLS)
        try:
            c = await self.client.chat(CONVERSATION, tools=TOOLS, max_tokens=1, temperature=0)
            if c.prompt_ids:
                sources["chat route prompt_token_ids"] = c.prompt_ids
        except PolicyBadRequest as e:
            too_long = self.max_model_len is not None and len(expected) >= self.max_model_len
            if not too_long:
                return Check("chat_template", FAIL, f"the chat route refused the conversation: {e.reason}")
            notes.append(f"the chat route refused it ({len(expected)} tokens, context {self.max_model_len})")
        if not sources:
            return Check("chat_template", SKIP, "the endpoint reports no prompt token ids (no prompt_token_ids on "
                         "its chat route, no /tokenize)" + (f"; {notes[0]}" if notes else ""))
        for where, got in sources.items():
            if got != expected:
                return Check("chat_template", FAIL, f"{where} differ from our template and tokenizer: "
                             + await self._diff(expected, got), {"expected": expected, "got": got})
        self.same_tokenizer = True
        return Check("chat_template", PASS, f"{len(expected)} tokens equal, id for id ({', '.join(sources)})"
                     + (f"; {notes[0]}" if notes else ""))

    async def _diff(self, expected: list[int], got: list[int]) -> str:
        i = next((k for k, (x, y) in enumerate(zip(expected, got, strict=False)) if x != y), min(len(expected), len(got)))
        want = self.tok.decode(expected[max(0, i - 4):i + 4])
        try:
            have = await self.client.detokenize(got[max(0, i - 4):i + 4])
        except PolicyError:
            have = self.tok.decode([t for t in got[max(0, i - 4):i + 4] if 0 <= t < self.tok.vocab_size])
        return (f"first difference at token {i} of {len(expected)} (endpoint: {len(got)} tokens): "
                f"ours {want!r}, endpoint's {have!r}")

    async def logprobs(self) -> Check:
        worst, where = 0.0, ""
        compared = 0
        for temperature, seed in ((1.0, 7), (0.0, None)):
            c = await self.client.complete(self.prompt, max_tokens=8, temperature=temperature, seed=seed)
            s = c.samples[0]
            if not s.token_ids or s.logprobs is None:
                return Check("logprob_consistency", FAIL, "no token ids or logprobs to compare")
            try:
                scored = await self.client.score(self.prompt + s.token_ids)
            except PolicyError as e:
                return Check("logprob_consistency", FAIL, f"cannot score given tokens (prompt_logprobs): {e}")
            again = scored[len(self.prompt):]
            if len(again) != len(s.logprobs) or any(x is None for x in again):
                return Check("logprob_consistency", FAIL, "prompt_logprobs do not cover the scored tokens")
            for i, (x, y) in enumerate(zip(s.logprobs, again, strict=True)):
                assert y is not None
                compared += 1
                if abs(x - y) > worst:
                    worst, where = abs(x - y), f"token {i} at temperature {temperature}: generated {x:.4f}, scored {y:.4f}"
        details = {"max_abs_diff": worst, "tolerance": self.tolerance, "tokens": compared}
        if worst > self.tolerance:
            return Check("logprob_consistency", FAIL, f"generation logprobs disagree with prompt_logprobs by "
                         f"{worst:.4f} nats (> {self.tolerance}): {where}", details)
        return Check("logprob_consistency", PASS, f"{compared} tokens agree within {worst:.2e} nats "
                     f"(tolerance {self.tolerance})", details)

    async def tool_call(self) -> list[Check]:
        choice = {"type": "function", "function": {"name": "get_weather"}}
        try:
            c = await self.client.chat([{"role": "user", "content": "What's the weather in Rome?"}], tools=TOOLS,
                                       tool_choice=choice, max_tokens=64, temperature=0)
        except PolicyBadRequest as e:
            return [Check("tool_call_parse", FAIL, f"a forced tool call was refused: {e.reason}"),
                    Check("tool_arguments_schema", SKIP, "no tool call to check")]
        s = c.samples[0]
        calls = (s.message or {}).get("tool_calls") or []
        if not calls:
            why = f"finish_reason {s.finish_reason!r}, content {str((s.message or {}).get('content'))[:80]!r}"
            return [Check("tool_call_parse", FAIL, f"a forced tool call came back without tool_calls ({why})"),
                    Check("tool_arguments_schema", SKIP, "no tool call to check")]
        theirs = [(t["function"]["name"], _json(t["function"].get("arguments"))) for t in calls]
        raw = await self._generated_text(c)
        if raw is None:
            parse = Check("tool_call_parse", SKIP, "cannot see the generated tokens as text (no token ids, or another "
                          "tokenizer and no /detokenize); the endpoint's own parse was not cross-checked")
        else:
            msg = parse_assistant(raw)
            ours = [(t["function"]["name"], _json(t["function"]["arguments"])) for t in msg.tool_calls]
            if msg.malformed or ours != theirs:
                parse = Check("tool_call_parse", FAIL, f"parse_assistant reads the generated text {raw[-120:]!r} as "
                              f"{ours if not msg.malformed else 'malformed'}, the endpoint reported {theirs}")
            else:
                parse = Check("tool_call_parse", PASS, f"the endpoint's tool_calls equal parse_assistant's ({ours[0][0]})")
        errors = [e for name, args in theirs for e in (
            ["arguments are not a JSON object"] if not isinstance(args, dict) else
            schema_errors(args, WEATHER_PARAMS) if name == "get_weather" else [f"called {name!r}, not get_weather"])]
        schema = (Check("tool_arguments_schema", FAIL, "; ".join(errors[:4])) if errors else
                  Check("tool_arguments_schema", PASS, f"arguments {json.dumps(theirs[0][1])[:80]} are valid"))
        return [parse, schema]

    async def _generated_text(self, c: Completion) -> str | None:
        """The assistant turn as generated: the prompt's part after the generation header (a forced tool call's
        opening) and the output tokens, as text (our tokenizer when it is the endpoint's, else /detokenize)."""
        s = c.samples[0]
        if not s.token_ids or not c.prompt_ids:
            return None
        if self.same_tokenizer:
            prompt, out = self.tok.decode(c.prompt_ids), self.tok.decode(s.token_ids)
        else:
            try:
                prompt, out = await self.client.detokenize(c.prompt_ids), await self.client.detokenize(s.token_ids)
            except PolicyError:
                return None
        head = prompt.rsplit(GENERATION_PROMPT, 1)[-1] if GENERATION_PROMPT in prompt else ""
        return (head + out).removesuffix(IM_END)

    async def structured(self) -> Check:
        fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER_SCHEMA, "strict": True}}
        try:
            c = await self.client.chat([{"role": "user", "content": "Is 7 prime? Answer as JSON."}],
                                       response_format=fmt, max_tokens=48, temperature=0)
        except PolicyBadRequest as e:
            if e.reason:
                return Check("structured_output", PASS, f"refused clearly ({e.status}): {e.reason[:100]}")
            return Check("structured_output", FAIL, f"refused with status {e.status} but no reason")
        content = (c.samples[0].message or {}).get("content") or ""
        try:
            value = json.loads(content)
        except ValueError:
            return Check("structured_output", FAIL, f"content is not JSON: {content[:80]!r} "
                         f"(finish_reason {c.samples[0].finish_reason!r})")
        errors = schema_errors(value, ANSWER_SCHEMA)
        if errors:
            return Check("structured_output", FAIL, "; ".join(errors[:4]))
        return Check("structured_output", PASS, f"{content[:80]} is valid under the schema")

    async def sampling(self) -> Check:
        accepted = []
        for what, override in CARD_VIOLATIONS:
            body = {"model": self.client.model, "prompt": self.prompt, "max_tokens": 2, **override}
            try:
                data = await self.client.request("POST", "/v1/completions", body)
            except PolicyBadRequest as e:
                if not e.reason:
                    accepted.append(f"{what}: {e.status} without a reason")
                continue
            if not data.get("warnings"):
                accepted.append(f"{what}: accepted silently")
        if accepted:
            return Check("sampling_constraints", FAIL, "; ".join(accepted))
        return Check("sampling_constraints", PASS, f"{len(CARD_VIOLATIONS)} out-of-range settings refused with a reason "
                     f"({', '.join(w for w, _ in CARD_VIOLATIONS)})")

    async def context(self) -> Check:
        if self.max_model_len is None:
            return Check("context_limit", SKIP, "the endpoint does not report max_model_len in /v1/models")
        L = self.max_model_len
        filler = self.tok.encode_text(" the")[0]
        try:
            await self.client.complete([filler] * (L + 8), max_tokens=4, temperature=0)
            return Check("context_limit", FAIL, f"a prompt of {L + 8} tokens (context {L}) was accepted")
        except PolicyBadRequest as e:
            if not e.reason:
                return Check("context_limit", FAIL, f"an over-long prompt got {e.status} without a reason")
            over = f"an over-long prompt is a {e.status}: {e.reason[:80]}"
        if L > 8192:
            return Check("context_limit", PASS, over + f" (the at-the-limit case is not sent: context {L} > 8192)")
        try:
            c = await self.client.complete([filler] * (L - 2), max_tokens=16, temperature=0)
        except PolicyBadRequest:
            return Check("context_limit", PASS, over + "; prompt + max_tokens over the context is refused")
        s = c.samples[0]
        if len(s.token_ids) > 2 or s.finish_reason != "length":
            return Check("context_limit", FAIL, f"at the limit it generated {len(s.token_ids)} tokens "
                         f"(finish_reason {s.finish_reason!r}) with 2 left in the context")
        return Check("context_limit", PASS, over + "; at the limit it stops with finish_reason 'length'")

    async def bad_requests(self) -> Check:
        model = self.client.model
        cases: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("malformed JSON", lambda: self._raw_post("/v1/chat/completions", b'{"model": "x", "messages": [')),
            ("unknown model", lambda: self.client.request("POST", "/v1/completions", {
                "model": f"{model}-no-such-model", "prompt": self.prompt, "max_tokens": 2})),
            ("unknown role", lambda: self.client.request("POST", "/v1/chat/completions", {
                "model": model, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2})),
            ("token id out of the vocabulary", lambda: self.client.request("POST", "/v1/completions", {
                "model": model, "prompt": [10 ** 9], "max_tokens": 2})),
        ]
        problems = []
        for what, send in cases:
            try:
                await send()
                problems.append(f"{what}: accepted")
            except PolicyBadRequest as e:
                if not e.reason:
                    problems.append(f"{what}: {e.status} without a reason")
            except PolicyError as e:
                problems.append(f"{what}: {type(e).__name__} {e}")
        try:
            await self.client.complete(self.prompt, max_tokens=2, temperature=0)
        except PolicyError as e:
            problems.append(f"no longer serving afterwards: {e}")
        if problems:
            return Check("bad_requests", FAIL, "; ".join(problems))
        return Check("bad_requests", PASS, f"{len(cases)} bad requests answered 4xx with a reason; still serving")

    async def _raw_post(self, path: str, content: bytes) -> None:
        r = await self.client.send_raw("POST", path, content, {"content-type": "application/json"})
        if 400 <= r.status_code < 500:
            raise PolicyBadRequest(f"{r.status_code}", r.status_code, error_reason(r))
        if r.status_code >= 500:
            raise PolicyError(f"{path}: {r.status_code}", r.status_code)


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
