"""Documented bug injections, SWE-smith style: small source edits at sites found with ``ast``.

Every mutation is a text edit at positions ``ast`` reports, so the rest of the file (comments,
formatting) is untouched and the gold patch is a few lines. A mutation spec pins one site:

    {"file": "toolz/itertoolz.py", "function": "partition_all", "kind": "compare_swap", "index": 0}

``index`` counts the sites of that kind inside that function (nested functions excluded), in
source order. The kinds:

- ``compare_swap``     a comparison operator flipped: < <=, > >=, == !=, in / not in, is / is not
- ``binop_swap``       an arithmetic or bitwise operator swapped: + -, * //, // *, % //, & |, | &
- ``off_by_one``       an integer literal moved by one: 0 -> 1, n -> n - 1
- ``bool_swap``        ``and`` <-> ``or``
- ``drop_operand``     one operand of an ``and`` / ``or`` removed (a condition dropped)
- ``remove_if``        an ``if`` statement without ``else`` deleted (a removed guard)
- ``swap_args``        the first two positional arguments of a call swapped
- ``delete_statement`` an assignment, augmented assignment or call statement deleted
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("compare_swap", "binop_swap", "off_by_one", "bool_swap", "drop_operand", "remove_if", "swap_args",
         "delete_statement")
_CMP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
        ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
        ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is")}
_BIN = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"), ast.FloorDiv: ("//", "*"),
        ast.Mod: ("%", "//"), ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&")}


class MutationError(ValueError):
    """A spec that does not match the source (no such function, kind or index)."""


@dataclass(frozen=True)
class MutationSpec:
    file: str
    function: str
    kind: str
    index: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MutationSpec:
        spec = cls(file=str(d["file"]), function=str(d["function"]), kind=str(d["kind"]), index=int(d["index"]))
        if spec.kind not in KINDS:
            raise MutationError(f"unknown mutation kind {spec.kind!r}; known: {', '.join(KINDS)}")
        return spec


@dataclass(frozen=True)
class Edit:
    start: int      # character offsets into the source
    end: int
    text: str
    line: int       # 1-based line of the site (for descriptions)
    description: str


class _Source:
    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0]
        for line in text.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))
        self.lines = text.splitlines(keepends=True)

    def off(self, lineno: int, col: int) -> int:
        """Character offset of (1-based line, UTF-8 byte column) as ast reports them."""
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.off(node.lineno, node.col_offset),  # type: ignore[attr-defined]
                self.off(node.end_lineno, node.end_col_offset))  # type: ignore[attr-defined]

    def seg(self, node: ast.AST) -> str:
        a, b = self.span(node)
        return self.text[a:b]


def functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, nested ones as ``outer.inner``."""
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def _own_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """Nodes of the function's body, not descending into nested functions, classes or lambdas."""
    out: list[ast.AST] = []
    stack: list[ast.AST] = list(reversed(fn.body))
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return [n for n in out if hasattr(n, "lineno")]


def _is_docstring(node: ast.AST, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return bool(fn.body) and node is fn.body[0] and isinstance(node, ast.Expr) and isinstance(
        node.value, ast.Constant) and isinstance(node.value.value, str)


def _blocks(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[int, list[ast.stmt]]:
    """id(statement) -> the statement list holding it, for every statement in the function."""
    out: dict[int, list[ast.stmt]] = {}
    for node in [fn, *_own_nodes(fn)]:
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                for s in block:
                    out[id(s)] = block
        for h in getattr(node, "handlers", []) or []:
            for s in h.body:
                out[id(s)] = h.body
    return out


def _delete_lines(src: _Source, stmt: ast.stmt, block: list[ast.stmt], what: str) -> Edit | None:
    """Delete a whole-line statement (``pass`` in its place when it is alone in its block)."""
    first = src.lines[stmt.lineno - 1]
    indent = first[: len(first) - len(first.lstrip())]
    if src.off(stmt.lineno, stmt.col_offset) != src.starts[stmt.lineno - 1] + len(indent):
        return None  # shares its first line with something else (e.g. `if x: y`)
    end_lineno = stmt.end_lineno or stmt.lineno
    end_line = src.lines[end_lineno - 1]
    after = end_line.encode()[stmt.end_col_offset or 0:].decode(errors="replace")
    if after.strip() and not after.strip().startswith("#"):
        return None
    start, end = src.starts[stmt.lineno - 1], src.starts[end_lineno]
    text = f"{indent}pass\n" if len(block) == 1 else ""
    return Edit(start, end, text, stmt.lineno, what)


def sites(source: str, kind: str) -> Iterator[tuple[str, Edit]]:
    """(function name, edit) for every site of ``kind`` in ``source``, in source order per function."""
    if kind not in KINDS:
        raise MutationError(f"unknown mutation kind {kind!r}; known: {', '.join(KINDS)}")
    tree = ast.parse(source)
    src = _Source(source)
    for name, fn in functions(tree):
        nodes = sorted(_own_nodes(fn), key=lambda n: (n.lineno, n.col_offset))  # type: ignore[attr-defined]
        blocks = _blocks(fn) if kind in ("remove_if", "delete_statement") else {}
        for node in nodes:
            edit = _site(src, kind, node, fn, blocks)
            if edit is not None:
                yield name, edit


def _site(src: _Source, kind: str, node: ast.AST, fn: ast.FunctionDef | ast.AsyncFunctionDef,
          blocks: dict[int, list[ast.stmt]]) -> Edit | None:
    line = getattr(node, "lineno", 0)
    if kind == "compare_swap" and isinstance(node, ast.Compare) and len(node.ops) == 1:
        pair = _CMP.get(type(node.ops[0]))
        if pair is None:
            return None
        a, b = src.span(node.left)[1], src.span(node.comparators[0])[0]
        between = src.text[a:b]
        pat = r"\bnot\s+in\b" if pair[0] == "not in" else r"\bis\s+not\b" if pair[0] == "is not" else (
            r"\b" + pair[0] + r"\b" if pair[0].isalpha() else re.escape(pair[0]))
        m = re.search(pat, between)
        if m is None:
            return None
        return Edit(a + m.start(), a + m.end(), pair[1], line, f"comparison '{pair[0]}' changed to '{pair[1]}'")
    if kind == "binop_swap" and isinstance(node, ast.BinOp):
        pair = _BIN.get(type(node.op))
        if pair is None:
            return None
        a, b = src.span(node.left)[1], src.span(node.right)[0]
        between = src.text[a:b]
        idx = between.find(pair[0])
        if idx < 0 or (pair[0] in "*" and between[idx:idx + 2] == "**"):
            return None
        return Edit(a + idx, a + idx + len(pair[0]), pair[1], line, f"operator '{pair[0]}' changed to '{pair[1]}'")
    if kind == "off_by_one" and isinstance(node, ast.Constant) and type(node.value) is int:
        a, b = src.span(node)
        if not src.text[a:b].isdigit():
            return None  # hex, underscores, ...
        new = node.value + 1 if node.value == 0 else node.value - 1
        return Edit(a, b, str(new), line, f"integer {node.value} changed to {new}")
    if kind == "bool_swap" and isinstance(node, ast.BoolOp):
        word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        a, b = src.span(node.values[0])[1], src.span(node.values[1])[0]
        m = re.search(r"\b" + word + r"\b", src.text[a:b])
        if m is None:
            return None
        return Edit(a + m.start(), a + m.end(), other, line, f"'{word}' changed to '{other}'")
    if kind == "drop_operand" and isinstance(node, ast.BoolOp) and len(node.values) == 2:
        a, b = src.span(node)
        keep = src.seg(node.values[0])
        if "\n" in src.text[a:b]:
            return None
        word = "and" if isinstance(node.op, ast.And) else "or"
        return Edit(a, b, keep, line, f"second operand of '{word}' removed")
    if kind == "swap_args" and isinstance(node, ast.Call) and len(node.args) >= 2:
        x, y = node.args[0], node.args[1]
        if any(isinstance(v, ast.Starred) for v in (x, y)):
            return None
        (xa, xb), (ya, yb) = src.span(x), src.span(y)
        tx, ty = src.text[xa:xb], src.text[ya:yb]
        if tx == ty or "\n" in src.text[xa:yb]:
            return None
        return Edit(xa, yb, ty + src.text[xb:ya] + tx, line, "first two arguments of a call swapped")
    if kind == "remove_if" and isinstance(node, ast.If) and not node.orelse and id(node) in blocks:
        return _delete_lines(src, node, blocks[id(node)], "an if statement (a guard) removed")
    deletable = isinstance(node, ast.Assign | ast.AugAssign) or (isinstance(node, ast.Expr)
                                                                 and isinstance(node.value, ast.Call))
    if kind == "delete_statement" and deletable and id(node) in blocks and not _is_docstring(node, fn):
        assert isinstance(node, ast.stmt)
        return _delete_lines(src, node, blocks[id(node)], "a statement deleted")
    return None


def apply(source: str, spec: MutationSpec) -> tuple[str, Edit]:
    """The mutated source and the edit made; MutationError when the spec names no site."""
    matching = [e for name, e in sites(source, spec.kind) if name == spec.function]
    if not matching:
        raise MutationError(f"{spec.file}: no {spec.kind} site in function {spec.function!r}")
    if not 0 <= spec.index < len(matching):
        raise MutationError(f"{spec.file}: {spec.function!r} has {len(matching)} {spec.kind} site(s), "
                            f"index {spec.index} is out of range")
    e = matching[spec.index]
    out = source[: e.start] + e.text + source[e.end:]
    if out == source:
        raise MutationError(f"{spec.file}: mutation {spec} changes nothing")
    try:
        ast.parse(out)
    except SyntaxError as err:
        raise MutationError(f"{spec.file}: mutation {spec} gives invalid Python ({err})") from None
    return out, e


def candidates(source: str, file: str) -> list[MutationSpec]:
    """Every mutation site of every kind in a file, as specs."""
    out = []
    for kind in KINDS:
        counts: dict[str, int] = {}
        for name, _edit in sites(source, kind):
            out.append(MutationSpec(file, name, kind, counts.get(name, 0)))
            counts[name] = counts.get(name, 0) + 1
    return out
