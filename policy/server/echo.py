"""The engine's own record of what it generated (``agentenv policy serve --echo FILE``).

An audit of a gateway or a rollout loop needs the engine's side written by the engine's process, never by the
client it audits: one JSON line per finished sequence, with the prompt ids it was given, the ids and logprobs it
sampled, the weight version, the finish reason and the sampling settings it ran with. The line is written on the
engine's thread when the sequence finishes, before the update that carries the finish reaches any client, so a
client that has its answer finds the line already there. The file is created 0600 and only appended to.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from policy.engine import Sequence


class Echo:
    """Appends one line per finished sequence to ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._lock = threading.Lock()

    def write(self, seq: Sequence) -> None:
        p = seq.params
        line = json.dumps({"prompt_ids": seq.prompt_ids, "output_ids": seq.output_ids, "logprobs": seq.logprobs,
                           "weight_version": seq.weight_version, "finish_reason": seq.finish_reason,
                           "sampling": {"temperature": p.temperature, "top_p": p.top_p, "max_tokens": p.max_tokens,
                                        "seed": p.seed}}, separators=(",", ":"))
        data = (line + "\n").encode()
        with self._lock:
            while data:
                data = data[os.write(self._fd, data):]

    def close(self) -> None:
        os.close(self._fd)
