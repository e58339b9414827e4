"""``agentenv policy verify URL``: check a K3 policy endpoint before any rollout uses it.

Third-party K3 endpoints differ in subtle ways that ruin RL and agents (a chat template off by one token, a
sampler whose logprobs are not the model's, tool calls the shared parser cannot read), so every check below
talks to the endpoint the way the rollout loop does (``policy.client``) and compares with our own K3 code
(``policy.chat``, the tokenizer). Each check ends PASS, FAIL or SKIP, always with a reason:

- ``models``: ``/v1/models`` lists the model (the one given, else the first listed is used);
- ``token_ids``: a completion of a token-id prompt returns the output token ids and one logprob per token;
- ``greedy_determinism``: greedy decoding gives the same tokens twice, and for every one of ``n`` samples;
- ``chat_template``: the endpoint's prompt token ids for a multi-turn conversation with tools, tool calls and
  tool results (its chat route's ``prompt_token_ids``, else ``/tokenize``) equal our tokenizer's ``encode_chat``
  (K3's template, text tokenised as text), id for id; a difference is shown as text at the first differing token;
- ``logprob_consistency``: logprobs returned for generated tokens (sampled at temperature 1 and greedy) equal
  the endpoint's own ``prompt_logprobs`` for the same tokens scored again, within ``tolerance`` nats: catches a
  sampler, temperature or precision mismatch between the rollout engine and the model;
- ``tool_call_parse``: a forced tool call comes back as ``tool_calls`` that ``policy.chat.parse_assistant``
  reads identically from the generated tokens (K3's tool-call format, not bare JSON);
- ``tool_arguments_schema``: those arguments are valid under the declared ``parameters``;
- ``structured_output``: ``response_format`` with a JSON schema gives JSON valid under it, or a clear 4xx;
- ``sampling_constraints``: sampling parameters outside what the model card allows are refused (4xx with a
  reason) or reported (a ``warnings`` field), never silently used;
- ``context_limit``: a prompt longer than the context is a 4xx with a reason; one at the limit either a 4xx or
  ends with ``finish_reason: "length"`` inside the context;
- ``bad_requests``: malformed JSON, an unknown model, an unknown role and out-of-vocabulary token ids are each a
  4xx with a reason, and the endpoint still serves afterwards.

``verify`` returns a ``VerifyReport``; the command prints a table (or ``--json``) and exits 1 on any FAIL. The checks
themselves are ``policy.checks``; the JSON-schema validator they use, ``policy.jsonschema``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from policy.checks import FAIL, PASS, SKIP, Check, Checks
from policy.client import PolicyClient, PolicyError
from policy.tokenizer import K3Tokenizer, load_tokenizer


@dataclass
class VerifyReport:
    url: str
    model: str | None
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == FAIL]

    def status(self, name: str) -> str | None:
        return next((c.status for c in self.checks if c.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.model, "ok": self.ok, "checks": [asdict(c) for c in self.checks]}


async def verify(url: str, token: str | None = None, model: str | None = None, *,
                 tokenizer: K3Tokenizer | None = None, tolerance: float = 0.02, timeout: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> VerifyReport:
    """Run every check against the endpoint at ``url`` (see the module docstring)."""
    tok = tokenizer or load_tokenizer()
    report = VerifyReport(url, model)
    async with PolicyClient(url, token, model, timeout=timeout, max_retries=1, transport=transport) as client:
        v = Checks(client, tok, tolerance)
        try:
            first = await v.models()
        except PolicyError as e:
            first = Check("models", FAIL, f"{type(e).__name__}: {e}")
        report.checks.append(first)
        report.model = client.model
        steps: list[tuple[str, Callable[[], Awaitable[Check | list[Check]]]]] = [
            ("token_ids", v.token_ids), ("greedy_determinism", v.greedy), ("chat_template", v.chat_template),
            ("logprob_consistency", v.logprobs), ("tool_call_parse", v.tool_call),
            ("structured_output", v.structured), ("sampling_constraints", v.sampling), ("context_limit", v.context),
            ("bad_requests", v.bad_requests)]
        for name, run in steps:
            if first.status != PASS:
                report.checks.append(Check(name, SKIP, "the model is not served"))
                if name == "tool_call_parse":
                    report.checks.append(Check("tool_arguments_schema", SKIP, "the model is not served"))
                continue
            try:
                out = await run()
            except PolicyError as e:
                out = Check(name, FAIL, f"{type(e).__name__}: {e}")
                if name == "tool_call_parse":
                    out = [out, Check("tool_arguments_schema", SKIP, "no tool call to check")]
            report.checks += out if isinstance(out, list) else [out]
    return report


def print_report(report: VerifyReport) -> None:
    """The report as a table: one row per check, its result and reason."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"policy endpoint {report.url} (model {report.model})")
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("reason")
    colour = {PASS: "green", FAIL: "red", SKIP: "yellow"}
    for c in report.checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.reason)
    console = Console()
    console.print(table)
    failed = report.failed()
    console.print(f"[red]FAILED: {', '.join(failed)}[/]" if failed else "[green]all checks passed[/]")
