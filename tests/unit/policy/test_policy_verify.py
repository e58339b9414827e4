"""``agentenv policy verify``: our server passes every check; a server with a deliberately altered chat template
fails ``chat_template`` (and only what follows from it), one whose sampler reports logprobs at another
temperature fails ``logprob_consistency``; the JSON-schema validator the checks use."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

import policy.engine
from policy.chat import IM_SYSTEM, IM_USER, Control, chat_pieces
from policy.jsonschema import schema_errors
from policy.server import create_app
from policy.verify import PASS, SKIP, verify

TOKEN = "t"


def _verify(app) -> object:
    return asyncio.run(verify("http://policy.test", TOKEN, transport=httpx.ASGITransport(app=app)))


def test_our_server_passes_every_check(server_app):
    pytest.importorskip("llguidance")  # forced tool calls of an untrained model are valid only when constrained
    report = _verify(server_app[0])
    assert report.ok, report.to_json()
    statuses = {c.name: c.status for c in report.checks}
    assert set(statuses) == {"models", "token_ids", "greedy_determinism", "chat_template", "logprob_consistency",
                             "tool_call_parse", "tool_arguments_schema", "structured_output", "sampling_constraints",
                             "context_limit", "bad_requests"}
    assert all(s == PASS for s in statuses.values()), report.to_json()
    assert all(c.reason for c in report.checks)


def test_an_altered_template_fails_the_template_check(engine_pair):
    pytest.importorskip("llguidance")
    def altered(messages, tools=None, add_generation_prompt=True):  # tool results under the user role token
        pieces = chat_pieces(messages, tools, add_generation_prompt)
        return [Control(IM_USER) if p == Control(IM_SYSTEM) and nxt == "tool" else p
                for p, nxt in zip(pieces, [*pieces[1:], None], strict=True)]

    report = _verify(create_app(engine_pair[0], TOKEN, template=altered))
    assert report.failed() == ["chat_template"], report.to_json()
    check = next(c for c in report.checks if c.name == "chat_template")
    assert "first difference at token" in check.reason and "im_user" in check.reason


def test_a_sampler_reporting_other_logprobs_fails_the_logprob_check(engine_pair, monkeypatch):
    real = policy.engine.sample

    def skewed(logits, params, gen):  # samples like the real one, reports logprobs at temperature x 0.8
        tok, _ = real(logits, params, gen)
        t = (params.temperature or 1.0) * 0.8
        return tok, float(torch.log_softmax(logits.float() / t, -1)[tok])

    monkeypatch.setattr(policy.engine, "sample", skewed)
    report = _verify(create_app(engine_pair[1], TOKEN))
    assert "logprob_consistency" in report.failed(), report.to_json()
    assert report.status("chat_template") == PASS and report.status("greedy_determinism") == PASS
    check = next(c for c in report.checks if c.name == "logprob_consistency")
    assert "disagree" in check.reason and check.details["max_abs_diff"] > check.details["tolerance"]


def test_an_unreachable_endpoint_fails_models_and_skips_the_rest():
    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    report = asyncio.run(verify("http://nowhere.test", transport=httpx.MockTransport(refuse)))
    assert report.failed() == ["models"] and "cannot connect" in report.checks[0].reason
    assert {c.status for c in report.checks[1:]} == {SKIP}


@pytest.mark.parametrize(("value", "ok"), [
    ({"a": "yes", "n": 3}, True), ({"a": "maybe", "n": 3}, False), ({"a": "yes"}, False),
    ({"a": "yes", "n": 3, "x": 1}, False), ({"a": "yes", "n": 300}, False), ({"a": "yes", "n": 2.5}, False),
    ([], False), ({"a": "yes", "n": 1, "tags": ["x", "yy"]}, True), ({"a": "yes", "n": 1, "tags": ["toolong"]}, False),
])
def test_schema_errors(value, ok):
    schema = {"type": "object", "required": ["a", "n"], "additionalProperties": False, "properties": {
        "a": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}}}
    assert (schema_errors(value, schema) == []) == ok
