"""One encoder for untrusted text, read from the source (issue 40, finding 6): outside ``ALLOWED`` nothing calls a
tokenizer's own ``encode`` (which turns control-token strings into control tokens), ``encode_batch`` or
``apply_chat_template``. Message content, tool output, file contents reach token ids only through
``policy.chat.ChatEncoder`` (``encode_text`` / ``encode_chat`` / ``encode_pieces``), where control ids come from the
template alone.

A call is a tokenizer's when its receiver is named like one (``tok``, ``TOK``, ``self._tok``, ``self.tokenizer``,
``hf_tokenizer``...): ``str.encode`` on other names is left alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("agentenv", "envs", "policy", "rollout", "trainer", "bench", "tests")
ALLOWED = {   # the files that call a raw encode, and why that is not message content
    "policy/tokenizer.py": "k3-mini's tokenizer: its raw encode is ChatEncoder's, called on text cut between controls",
    "tests/integration/frameworks/test_openrlhf.py": "stands in for OpenRLHF's own Hugging Face tokenizer",
    "tests/integration/frameworks/trl_scripted.py": "scripts the generated tokens of TRL's Qwen2 test model",
}
RAW = {"encode", "encode_batch", "encode_batch_fast", "apply_chat_template"}
TOKENIZER_NAME = re.compile(r"(?i)^_?(tok|tokenizer|tokeniser|\w+_tokenizer)$")


def _receiver_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def raw_encodes(root: Path, folders: tuple[str, ...]) -> list[str]:
    """``path:line call`` of every raw tokenizer encode outside ``ALLOWED``."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in ALLOWED:
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RAW
                        and (node.func.attr == "apply_chat_template"
                             or TOKENIZER_NAME.match(_receiver_name(node.func.value)))):
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node.func)}")
    return found


def test_nothing_but_the_tokenizer_module_encodes_text_raw():
    assert raw_encodes(ROOT, SCANNED) == []


def test_the_scan_finds_a_raw_encode_at_any_depth(tmp_path):
    """The checker itself: a tokenizer's encode in a method, a nested call and a verl-style adapter are found;
    ``str.encode`` and the safe encoders are not."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "a.py").write_text("class A:\n    def f(self, m):\n        return self.tokenizer.encode(m['content'])\n")
    (pkg / "b.py").write_text("def g(tok, hf_tokenizer, s):\n    x = [TOK.encode(s)]\n"
                              "    return hf_tokenizer.apply_chat_template(s), tok.encode_text(s), s.encode()\n")
    (pkg / "c.py").write_text("def h(token, text):\n    return f'Bearer {token}'.encode(), token.encode(), "
                              "text.encode('utf-8')\n")
    assert raw_encodes(tmp_path, ("p",)) == ["p/a.py:3 self.tokenizer.encode", "p/b.py:2 TOK.encode",
                                             "p/b.py:3 hf_tokenizer.apply_chat_template"]
