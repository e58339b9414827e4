"""A small byte-level BPE tokenizer with K3's special tokens as single tokens.

Text becomes ids only through ``policy.chat.ChatEncoder`` (``K3Tokenizer`` is one): control-token strings inside
text stay text, control ids come from the chat template alone (issue 40).

It is trained with the ``tokenizers`` library on ``policy/data/corpus.txt`` (shipped in the repo) and cached
as ``policy/data/tokenizer.json``; ``load_tokenizer`` retrains deterministically only if the cache is missing.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from policy.chat import ChatEncoder

DATA = Path(__file__).parent / "data"
CORPUS, CACHE = DATA / "corpus.txt", DATA / "tokenizer.json"
VOCAB_SIZE = 4096

# K3's chat and tool-call control tokens (a subset of the real 163840-token vocabulary's specials)
SPECIAL_TOKENS = [
    "[BOS]", "[EOS]", "[PAD]", "[UNK]",
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|open|>", "<|sep|>", "<|close|>",
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


class K3Tokenizer(ChatEncoder):
    """k3-mini's tokenizer as a ``policy.chat.ChatEncoder``: text to ids with control strings kept as text
    (``encode_text``), chat messages to ids (``encode_chat``), ids back to text (``decode``). ``tok`` is the
    ``tokenizers`` object; its own ``encode`` makes control ids of control strings, so only this module calls it."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        super().__init__(lambda text: tok.encode(text, add_special_tokens=False).ids,
                         lambda ids: tok.decode(ids, skip_special_tokens=False), specials)
        self.bos_id, self.pad_id = self.token_id("[BOS]"), self.token_id("[PAD]")


@lru_cache(maxsize=1)
def load_tokenizer() -> K3Tokenizer:
    """The packaged tokenizer; trained and cached on first use if the JSON is absent."""
    if not CACHE.exists():
        train_tokenizer().save(str(CACHE))
    return K3Tokenizer(Tokenizer.from_file(str(CACHE)))


if __name__ == "__main__":  # regenerate the cached tokenizer: python -m policy.tokenizer
    train_tokenizer().save(str(CACHE))
    print(f"wrote {CACHE} ({Tokenizer.from_file(str(CACHE)).get_vocab_size()} tokens)")
