"""A scripted policy for TRL's real ``GRPOTrainer``, built locally (no download): a byte-level tokenizer with TRL's
own Qwen3 chat template (so TRL's tool-call parser applies) and a one-layer Qwen2 whose generation is forced
onto a script of tool calls, one script a rollout of the group (row ``b`` of each generate call follows
``scripts[b]``), one reply a turn (a turn is counted by the tool responses in the sequence so far)."""

from __future__ import annotations

import json
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl.chat_template_utils import qwen3_chat_template

MARKS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left")
    fast.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                             "additional_special_tokens": ["<|im_start|>", *MARKS]})
    fast.chat_template = qwen3_chat_template
    return fast


def tool_call(name: str, **arguments: Any) -> str:
    """A Qwen3 tool call and the end of the turn."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


class ScriptedQwen2(Qwen2ForCausalLM):
    """Qwen2 whose next token while generating (no grad) is the script's; training sees the model's own logits."""

    def set_script(self, tok: PreTrainedTokenizerFast, scripts: list[list[str]]) -> None:
        self.scripts = [[tok.encode(turn, add_special_tokens=False) for turn in s] for s in scripts]
        self.im_start = tok.convert_tokens_to_ids("<|im_start|>")
        self.response = tok.convert_tokens_to_ids("<tool_response>")
        self.head = tok.encode("assistant\n", add_special_tokens=False)
        self.eos = tok.eos_token_id

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        out = super().forward(input_ids=input_ids, **kwargs)
        if torch.is_grad_enabled() or input_ids is None:
            return out
        rows = input_ids.tolist()
        if input_ids.shape[1] > 1:  # the prefill of a generate call: where each row stands in its script
            self._at = [self._position(b, row) for b, row in enumerate(rows)]
        else:  # one new token a row (the KV cache holds the rest)
            self._at = [(turn, k + 1) for turn, k in self._at]
        logits = out.logits.clone()
        for b, (turn, k) in enumerate(self._at):
            logits[b, -1, turn[k] if k < len(turn) else self.eos] += 1e4
        out.logits = logits
        return out

    def _position(self, b: int, row: list[int]) -> tuple[list[int], int]:
        """Row ``b``'s reply of this turn and how many of its tokens the row already holds."""
        starts = [i for i, t in enumerate(row) if t == self.im_start and row[i + 1:i + 1 + len(self.head)] == self.head]
        script = self.scripts[b % len(self.scripts)]
        return script[min(row.count(self.response), len(script) - 1)], len(row) - (starts[-1] + 1 + len(self.head))


def model(tok: PreTrainedTokenizerFast, scripts: list[list[str]]) -> ScriptedQwen2:
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    m = ScriptedQwen2(cfg)
    m.set_script(tok, scripts)
    return m
