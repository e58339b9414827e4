"""What the run_code kernel (``kernel.py``) shows of a value, a figure or an exception: the fields of e2b's
``Result`` (a value's formats, as Jupyter's MIME bundle and ``_repr_*_`` methods give them; binary formats as base64
text) and of its ``Error`` (the traceback without the kernel's own frames).

Part of the kernel: the standard library only, joined with the kernel's other files into the one module that runs
in the sandbox (``kernel.PARTS``), so its names are the kernel's globals and must not clash with theirs. Apart
from the kernel's request loop because none of it touches the protocol channel: each returns the fields that the
kernel writes as an event.
"""

from __future__ import annotations

import base64
import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

MIMES = {  # Jupyter's MIME types and the keys of e2b's Result; any other goes to ``extra``
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
    "e2b/chart": "chart",
}
_REPRS = [(mime, f"_repr_{key}_") for mime, key in MIMES.items() if key not in ("text", "data", "chart")]
_BINARY = ("png", "jpeg", "pdf")  # base64 text on the wire
_OWN_FILE = (lambda: None).__code__.co_filename  # the kernel's own frames are left out of user tracebacks
_to_json = json.dumps  # bound once: user code may patch the module


def _repr_call(obj: Any, name: str, *args: Any) -> Any:
    """``obj.name(*args)``, or None where it is missing or fails (as IPython's formatters skip it)."""
    if isinstance(obj, type):
        return None
    try:
        method = getattr(obj, name, None)
        return method(*args) if callable(method) else None
    except Exception:
        return None


def formats(obj: Any, raw: bool = False) -> dict[str, Any]:
    """The formats of e2b's Result for ``obj`` (a MIME bundle itself where ``raw``)."""
    bundle = obj if raw and isinstance(obj, dict) else _repr_call(obj, "_repr_mimebundle_", None, None)
    if isinstance(bundle, tuple) and bundle:
        bundle = bundle[0]
    mimes: dict[str, Any] = dict(bundle) if isinstance(bundle, dict) else {}
    if not raw:
        for mime, name in _REPRS:
            if mime not in mimes and (value := _repr_call(obj, name)) is not None:
                mimes[mime] = value
        if "text/plain" not in mimes:
            mimes["text/plain"] = repr(obj)
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for mime, value in mimes.items():
        key = MIMES.get(mime)
        if isinstance(value, tuple) and len(value) == 2:  # (data, metadata)
            value = value[0]
        if isinstance(value, (bytes, bytearray)):
            value = base64.b64encode(value).decode() if key in _BINARY else bytes(value).decode("utf-8", "replace")
        if key is not None and not isinstance(value, dict if key in ("json", "data", "chart") else str):
            continue
        try:
            _to_json(value)
        except Exception:
            continue
        if key is None:
            extra[str(mime)] = value
        else:
            out[key] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) > 1 and text[0] == text[-1] == "'":
        out["text"] = text[1:-1]  # as e2b's server gives a string: without its quotes
    out["extra"] = extra
    return out


def figures() -> Iterator[dict[str, Any]]:
    """Matplotlib's open figures as png results, one at a time, then all closed (as Jupyter's inline backend does)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    import io
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        yield {"text": repr(fig), "png": base64.b64encode(buf.getvalue()).decode(), "extra": {}}
    plt.close("all")


INLINE_BACKEND = "agentenv_inline"  # matplotlib's backend in the kernel: MPLBACKEND=module://agentenv_inline


class InlineBackend(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Matplotlib's backend in the kernel, as Jupyter's inline one: Agg's canvas, and ``plt.show()`` emits the open
    figures at once (``show``), so a chart comes before the cell's result; a figure left open comes after it. A
    finder of the one module name, since the kernel runs from no file, and matplotlib is imported only if the cell
    does."""

    def __init__(self, show: Callable[[], None]) -> None:
        self.show = show

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if name == INLINE_BACKEND else None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        # the cell's own matplotlib, which is loading this backend: never imported otherwise
        backend_agg = importlib.import_module("matplotlib.backends.backend_agg")
        module.FigureCanvas, module.FigureManager = backend_agg.FigureCanvasAgg, backend_agg.FigureManager
        module.show = lambda *args, **kwargs: self.show()


def _own(filename: str) -> bool:
    return filename == _OWN_FILE or f"{os.sep}asyncio{os.sep}" in filename


def error_text(exc: BaseException) -> str:
    """The traceback of ``exc`` and of those it chains, without the kernel's own frames."""
    top = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    todo, seen = [top], set()
    while todo:  # the exception and those it chains
        te = todo.pop()
        if id(te) not in seen:
            seen.add(id(te))
            te.stack = traceback.StackSummary.from_list([f for f in te.stack if not _own(f.filename)])
            todo += [c for c in (te.__cause__, te.__context__) if c is not None]
    return "".join(top.format())
