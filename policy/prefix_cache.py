"""The engine's ledger of kept prefix states: which token prefixes have a decoding state kept, on which EP rank,
and how many bytes it holds; least recently used entries go first when the budget is exceeded.

The states themselves (KDA's fixed-size recurrent state and conv tails plus the MLA latents) stay on the rank
that computed them (``Runner.entries``); this ledger, on rank 0, decides alone what is kept and what is dropped,
and the runners do what the step plan says (``keep``, a job's ``save`` and ``start``, ``drop``). So every rank
agrees on the entries without asking, and a sequence that reuses a prefix runs on the rank that holds it.

Two kinds of entry: the state right after a prompt's prefill, with its last logits (a request for exactly that
prompt, such as the other ``n - 1`` samples of a request or the next request of a GRPO group, forks it with no
forward at all), and the state at the end of a finished sequence (prompt + output, less the last token, which
was never fed), which the next turn of a multi-turn episode extends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from policy.config import K3Config


@dataclass
class PrefixEntry:
    """One kept state: its id (the runners' key), the rank holding it, its tokens and its size."""

    id: int
    rank: int
    tokens: tuple[int, ...]
    nbytes: int
    has_logits: bool


def state_nbytes(cfg: K3Config, n_tokens: int, elem: int = 4) -> int:
    """Bytes of one sequence's decoding state after ``n_tokens``: KDA's fixed part plus MLA's latents."""
    n_kda = len(cfg.kda_layers)
    n_mla = len(cfg.full_attn_layers)
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    kda = n_kda * (3 * H * K * (cfg.short_conv_kernel_size - 1) + H * K * K) * elem
    mla = n_mla * n_tokens * ((cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem + 1)
    return kda + mla


class PrefixIndex:
    """Kept prefix states under a byte budget and an entry limit, least recently used first out."""

    def __init__(self, max_bytes: int, max_entries: int = 256) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._by_tokens: dict[tuple[int, ...], int] = {}
        self._lengths: dict[int, int] = {}  # prefix length -> how many entries have it
        self._next_id = 0
        self._dropped: list[int] = []  # ids removed since the runners were last told
        self.nbytes = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], accept: Callable[[PrefixEntry], bool] | None = None) -> PrefixEntry | None:
        """The longest kept prefix that ``prompt`` extends (or equals, when the entry has its last logits) and that
        ``accept`` (when given) takes; marks it as used."""
        n = len(prompt)
        for length in sorted(self._lengths, reverse=True):
            if length > n:
                continue
            eid = self._by_tokens.get(tuple(prompt[:length]))
            if eid is None:
                continue
            entry = self._entries[eid]
            if (length == n and not entry.has_logits) or (accept is not None and not accept(entry)):
                continue
            self._entries.move_to_end(eid)
            return entry
        return None

    def find(self, tokens: list[int] | tuple[int, ...]) -> PrefixEntry | None:
        """The entry kept for exactly ``tokens`` (not marked as used), or None."""
        eid = self._by_tokens.get(tuple(tokens))
        return None if eid is None else self._entries[eid]

    def add(self, rank: int, tokens: list[int] | tuple[int, ...], nbytes: int, has_logits: bool) -> PrefixEntry | None:
        """Register a state to keep; None (nothing to keep) when those tokens are kept already or it could never
        fit. An existing entry without logits is replaced by one with them."""
        key = tuple(tokens)
        if not self.enabled or not key or nbytes > self.max_bytes:
            return None
        old = self._by_tokens.get(key)
        if old is not None:
            if self._entries[old].has_logits or not has_logits:
                self._entries.move_to_end(old)
                return None
            self._remove(old)
            self.evictions -= 1  # a replacement, not an eviction
            self._dropped.append(old)
        entry = PrefixEntry(self._next_id, rank, key, nbytes, has_logits)
        self._next_id += 1
        self._entries[entry.id] = entry
        self._by_tokens[key] = entry.id
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.nbytes += nbytes
        return entry

    def evict(self, protect: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Drop least recently used entries (never those in ``protect``) until within budget; returns every
        entry id dropped since the last call (replacements included), for the runners."""
        for eid in list(self._entries):
            if self.nbytes <= self.max_bytes and len(self._entries) <= self.max_entries:
                break
            if eid not in protect:
                self._remove(eid)
                self._dropped.append(eid)
        out, self._dropped = self._dropped, []
        return out

    def clear(self) -> list[int]:
        """Forget every entry (the weights changed); returns the ids to drop."""
        ids = [*self._dropped, *self._entries]
        self._entries.clear()
        self._by_tokens.clear()
        self._lengths.clear()
        self._dropped = []
        self.nbytes = 0
        return ids

    def _remove(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        del self._by_tokens[entry.tokens]
        self._lengths[len(entry.tokens)] -= 1
        if not self._lengths[len(entry.tokens)]:
            del self._lengths[len(entry.tokens)]
        self.nbytes -= entry.nbytes
        self.evictions += 1
