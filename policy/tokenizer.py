"""A small byte-level BPE tokenizer with K3's special tokens as single tokens.

It is trained with the ``tokenizers`` library on ``policy/data/corpus.txt`` (shipped in the repo) and cached
as ``policy/data/tokenizer.json``; ``load_tokenizer`` retrains deterministically only if the cache is missing.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DATA = Path(__file__).parent / "data"
CORPUS, CACHE = DATA / "corpus.txt", DATA / "tokenizer.json"
VOCAB_SIZE = 4096

# K3's chat and tool-call control tokens (a subset of the real 163840-token vocabulary's specials)
SPECIAL_TOKENS = [
    "[BOS]", "[EOS]", "[PAD]", "[UNK]",
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<think>", "</think>", "<|media_pad|>",
]


def train_tokenizer(corpus: Path = CORPUS, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train byte-level BPE on ``corpus``; the special tokens take ids 0..len(SPECIAL_TOKENS)-1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(corpus)], trainer)
    return tok


class K3Tokenizer:
    """Encode text (special tokens recognised) to ids and decode ids back, keeping special tokens."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.bos_id, self.eos_id, self.pad_id = (self.token_id(t) for t in ("[BOS]", "<|im_end|>", "[PAD]"))

    def token_id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


@lru_cache(maxsize=1)
def load_tokenizer() -> K3Tokenizer:
    """The packaged tokenizer; trained and cached on first use if the JSON is absent."""
    if not CACHE.exists():
        train_tokenizer().save(str(CACHE))
    return K3Tokenizer(Tokenizer.from_file(str(CACHE)))


if __name__ == "__main__":  # regenerate the cached tokenizer: python -m policy.tokenizer
    train_tokenizer().save(str(CACHE))
    print(f"wrote {CACHE} ({Tokenizer.from_file(str(CACHE)).get_vocab_size()} tokens)")
