"""``agentenv rollout gateway``: the LLM gateway as a server of its own, for harnesses a run drives from outside.

    agentenv rollout gateway --policy-url http://127.0.0.1:8000 --policy-token-file policy.token \\
                             --token-file gateway.token --port 8701

It binds to 127.0.0.1 unless told otherwise. Its admin token (``--token-file``, else ``$AGENTENV_GATEWAY_TOKEN``,
else a fresh one printed once on stderr) opens sessions (``POST /admin/sessions``, ``rollout.gateway.admin``); each
session's capability is what a harness gets. The tokenizer must be the engine's: k3-mini's by default, or a Hugging
Face tokenizer folder (``--tokenizer``, read with ``transformers``).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Annotated, cast

import typer

from policy.chat import ChatEncoder, HFTokenizer

app = typer.Typer(help="The LLM gateway: train unmodified harnesses (OpenAI and Anthropic APIs in front of a "
                       "token-id engine).")

TokenFile = Annotated[Path | None, typer.Option(exists=True, dir_okay=False)]


def _token(path: Path | None, env: str) -> str | None:
    if path is not None:
        token = path.read_text().strip()
        if not token:
            raise typer.BadParameter(f"{path} is empty; write the token into it")
        return token
    return os.environ.get(env) or None


def load_encoder(tokenizer: str) -> ChatEncoder:
    """k3-mini's tokenizer, or a Hugging Face tokenizer folder wrapped as a ``ChatEncoder``."""
    if tokenizer == "k3-mini":
        from policy.tokenizer import load_tokenizer

        return load_tokenizer()
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise typer.BadParameter("--tokenizer PATH needs transformers (pip install transformers)") from None
    # transformers' tokenizer classes hold what HFTokenizer reads, as properties its stubs do not declare as such
    return ChatEncoder.wrap(cast(HFTokenizer, AutoTokenizer.from_pretrained(tokenizer)))


@app.callback(invoke_without_command=True)
def serve(
    policy_url: Annotated[str, typer.Option(help="the engine: ours, vLLM or SGLang (token ids in and out)")],
    policy_token_file: Annotated[Path | None, typer.Option(exists=True, dir_okay=False,
                                                           help="the engine's token (else $AGENTENV_POLICY_TOKEN)")]
    = None,
    token_file: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="the gateway's admin token "
                                                    "(else $AGENTENV_GATEWAY_TOKEN, else a new one, printed)")]
    = None,
    tokenizer: Annotated[str, typer.Option(help="k3-mini, or a Hugging Face tokenizer folder: the engine's")]
    = "k3-mini",
    model: Annotated[str, typer.Option(help="the name /v1/models lists (a harness may ask for any)")] = "k3-mini",
    host: Annotated[str, typer.Option(help="bind address (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8701,
) -> None:
    """Serve the gateway."""
    import uvicorn

    from rollout.gateway.app import create_app
    from rollout.gateway.turns import Gateway
    from rollout.gateway.upstream import Upstream

    admin = _token(token_file, "AGENTENV_GATEWAY_TOKEN")
    if admin is None:
        admin = secrets.token_urlsafe(32)
        print(f"gateway admin token: {admin}", file=sys.stderr)
    upstream = Upstream(policy_url, _token(policy_token_file, "AGENTENV_POLICY_TOKEN"))
    gateway = Gateway(upstream, load_encoder(tokenizer))
    print(f"gateway on http://{host}:{port} (sessions: POST /admin/sessions)", file=sys.stderr)
    uvicorn.run(create_app(gateway, model, admin), host=host, port=port, log_level="warning", proxy_headers=False)
