"""A session's tape: every engine call of one episode as token ids, in a tree of branches.

Token fidelity is decided here. A request whose history extends an earlier call (that call's prompt messages, then
the answer the gateway gave, as ``messages.said`` compares them) is that call's prompt ids and its sampled ids
verbatim, plus the new tail rendered alone (``encode_chat`` of the messages after the answer, which starts and ends
at a control token as the whole template does): nothing generated is ever tokenised again. Any other request is
rendered whole and starts a new branch, labelled with its cause against the call whose history it shares most:

``start``             the session's first call
``extend``            (not a break) the next call of the same branch
``sibling``           it extends a call that another call extended already (a second continuation of one state)
``resample``          the same prompt again, not recognised as a retry
``tools_changed``     the tool declarations differ
``thinking_stripped`` the answer came back without its reasoning (thinking policy ``follow``)
``answer_edited``     the answer came back changed
``answer_dropped``    the history goes on without the answer (mini-swe-agent drops an answer it could not parse)
``compacted``         the history came back shorter, rewritten from some point (a summary)
``history_edited``    an earlier message changed
``subagent``          nothing in common (another system prompt, another conversation)

Each call records what the engine generated (prompt ids, sampled ids, logprobs, weight version), the sampling
settings it ran with and the template's hash. Its tree parent is the earlier call with the longest common token
prefix (``fork_at``: that prefix's length). ``branches`` lists each branch's calls; ``rollout.gateway.export``
makes a trajectory of each.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from policy.chat import ChatEncoder
from rollout.gateway.messages import Message, canonical, said

CAUSES = ("start", "extend", "sibling", "resample", "tools_changed", "thinking_stripped", "answer_edited",
          "answer_dropped", "compacted", "history_edited", "subagent")
THINKING = ("keep", "follow")


@dataclass
class Node:
    """One engine call of a session."""

    index: int
    branch: int
    cause: str
    parent: int | None              # tree parent: the call with the longest common token prefix
    fork_at: int                    # tokens shared with the parent
    messages: list[Message]         # the request's history, canonical
    tools_key: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_version: int | None = None
    weight_versions: list[int] = field(default_factory=list)   # every version that generated a part (a weight push
    sampling: dict[str, Any] = field(default_factory=dict)     # mid-call continues the same sequence on new weights)
    template: str = ""
    answer: Message = field(default_factory=dict)
    finish: str = ""
    malformed: bool = False
    body_hash: str = ""
    seconds: float = 0.0
    failed: bool = False
    forced: int = 0                 # ids at the prompt's end that force a tool call (``tool_choice``), not sampled

    @property
    def said(self) -> Message:
        """The answer, canonical (what a harness's history is compared with)."""
        return canonical([self.answer])[0] if self.answer else {}

    @property
    def seen(self) -> list[Message]:
        """The history this call was asked with, then its answer (canonical)."""
        return [*self.messages, self.said]

    @property
    def done(self) -> bool:
        return bool(self.finish) and not self.failed

    def full_ids(self, eos_id: int) -> list[int]:
        """The prompt, the sampled ids and the end-of-turn token when the engine stopped before it."""
        tail = [] if self.output_ids and self.output_ids[-1] == eos_id else [eos_id]
        return [*self.prompt_ids, *self.output_ids, *tail]


@dataclass(frozen=True)
class Plan:
    """How the next call's prompt was made: its ids, its branch and cause, and the call it extends (if any)."""

    prompt_ids: list[int]
    branch: int
    cause: str
    parent: int | None
    fork_at: int


def tools_key(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, sort_keys=True, separators=(",", ":"))


def template_hash(tokenizer: ChatEncoder) -> str:
    """A hash of the chat template and tokenizer together: the ids of a conversation that uses every part."""
    probe: list[Message] = [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": [
            {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "t"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ids = tokenizer.encode_chat(probe, tools, add_generation_prompt=True)
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def _common(a: list[Any], b: list[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Tape:
    """The calls of one session (see the module docstring). Not thread-safe: one event loop owns it."""

    def __init__(self, tokenizer: ChatEncoder, thinking: str = "keep") -> None:
        if thinking not in THINKING:
            raise ValueError(f"thinking must be one of {', '.join(THINKING)}, got {thinking!r}")
        self.tokenizer, self.thinking = tokenizer, thinking
        self.nodes: list[Node] = []
        self._branches = 0

    # --- planning the next prompt ---------------------------------------------------------------------------
    def _answered(self, node: Node, msg: Message) -> bool:
        """True if ``msg`` (from the harness) is ``node``'s answer, under the thinking policy."""
        if msg.get("role") != "assistant":
            return False
        stripped = msg.get("reasoning_content") is None
        keep = self.thinking == "keep" and stripped
        return said(msg, with_reasoning=not keep) == said(node.said, with_reasoning=not keep)

    def _extended(self, canon: list[Message], key: str) -> Node | None:
        """The done call this history extends (its prompt messages, then its answer); the longest, then latest."""
        best: Node | None = None
        for node in reversed(self.nodes):
            k = len(node.messages)
            if (node.done and node.tools_key == key and len(canon) > k and canon[:k] == node.messages
                    and self._answered(node, canon[k]) and (best is None or k > len(best.messages))):
                best = node
        return best

    def plan(self, messages: list[Message], tools: list[dict[str, Any]]) -> Plan:
        """The prompt for a request with this history and these tools (see the module docstring)."""
        canon, key = canonical(messages), tools_key(tools)
        node = self._extended(canon, key)
        ref = self._reference(canon, key)
        if node is not None:
            base = node.full_ids(self.tokenizer.eos_id)
            tail = self.tokenizer.encode_chat(messages[len(node.messages) + 1:], None, add_generation_prompt=True)
            if all(n.parent != node.index or n.cause != "extend" or n.failed for n in self.nodes):
                return Plan(base + tail, node.branch, "extend", node.index, len(base))
            # another call continued this one already: a sibling, unless the history follows a later call and
            # breaks from it (its answer changed, a message after it edited): then that break is the cause
            deeper = ref is not None and _common(canon, ref.seen) > len(node.messages) + 1
            cause = self._cause(canon, key, ref) if deeper and ref is not None else "sibling"
            return Plan(base + tail, self._new_branch(), cause, node.index, len(base))
        ids = self.tokenizer.encode_chat(messages, tools or None, add_generation_prompt=True)
        parent, fork_at = self._closest(ids)
        return Plan(ids, self._new_branch(), self._cause(canon, key, ref), parent, fork_at)

    def _reference(self, canon: list[Message], key: str) -> Node | None:
        """The done call whose history and answer share the longest prefix with ``canon``; of equals, one with the same
        tools, then the one with the shortest history (where ``canon`` departs is nearest its answer), then the latest."""
        done = [n for n in self.nodes if n.done]
        return max(done, key=lambda n: (_common(canon, n.seen), n.tools_key == key, -len(n.messages), n.index)) \
            if done else None

    def _new_branch(self) -> int:
        self._branches += 1
        return self._branches - 1

    def _closest(self, ids: list[int]) -> tuple[int | None, int]:
        best, at = None, 0
        for node in self.nodes:
            n = _common(ids, node.full_ids(self.tokenizer.eos_id))
            if n > at:
                best, at = node.index, n
        return best, at

    def _cause(self, canon: list[Message], key: str, ref: Node | None) -> str:
        """Why a history that does not continue ``ref`` (the call it shares most with) was asked for."""
        if ref is None:
            return "start"
        seen = ref.seen
        common = _common(canon, seen)
        if ref.tools_key != key:
            return "tools_changed"
        if canon == ref.messages:
            return "resample"
        if common == 0 or canon[0].get("role") != seen[0].get("role"):
            return "subagent"
        if common == len(ref.messages) and common < len(canon):
            if canon[common].get("role") != "assistant":
                return "answer_dropped"
            if said(canon[common], with_reasoning=False) == said(ref.said, with_reasoning=False):
                return "thinking_stripped"
            return "answer_edited"
        if common < len(canon) and len(canon) < len(seen):
            return "compacted"
        return "history_edited"

    # --- recording ------------------------------------------------------------------------------------------
    def open(self, plan: Plan, messages: list[Message], tools: list[dict[str, Any]], forced: list[int],
             body_hash: str, sampling: dict[str, Any], template: str) -> Node:
        node = Node(len(self.nodes), plan.branch, plan.cause, plan.parent, plan.fork_at, canonical(messages),
                    tools_key(tools), plan.prompt_ids + forced, sampling=sampling, template=template,
                    body_hash=body_hash, forced=len(forced))
        self.nodes.append(node)
        return node

    def fail(self, node: Node) -> None:
        """A call that did not finish (the engine failed): it stays on the tape, in no branch and extended by none."""
        node.failed = True

    def answered(self, body_hash: str) -> Node | None:
        """The done call a request with this body hash already got (a retry), the latest."""
        return next((n for n in reversed(self.nodes) if n.done and n.body_hash == body_hash), None)

    def branches(self) -> list[list[Node]]:
        """Each branch's calls, in order."""
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            if n.done:
                out.setdefault(n.branch, []).append(n)
        return [out[b] for b in sorted(out)]

    def causes(self) -> dict[str, int]:
        """How many calls had each cause (``extend`` included)."""
        counts = dict.fromkeys(CAUSES, 0)
        for n in self.nodes:
            if n.done:
                counts[n.cause] += 1
        return {k: v for k, v in counts.items() if v}
