"""``agentenv policy ...``: serve the k3-mini policy with expert parallelism behind the OpenAI-compatible API.

The bearer token comes from ``--token-file`` or ``$AGENTENV_POLICY_TOKEN``, never from the command line, which every
local user reads (``ps``)."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="The K3 policy: k3-mini model, expert-parallel engine, OpenAI-compatible server.",
                  no_args_is_help=True)


TokenFile = Annotated[Path | None, typer.Option(exists=True, dir_okay=False,
                                                help="file holding the bearer token (else $AGENTENV_POLICY_TOKEN)")]


def read_token(token_file: Path | None) -> str | None:
    """The bearer token: the file's (stripped), else $AGENTENV_POLICY_TOKEN, else None."""
    token = token_file.read_text().strip() if token_file else os.environ.get("AGENTENV_POLICY_TOKEN", "").strip()
    if token_file and not token:
        raise typer.BadParameter(f"{token_file} is empty; write the token into it")
    return token or None


@app.command()
def serve(
    preset: Annotated[str, typer.Option(help="model preset")] = "k3-mini",
    ep: Annotated[int, typer.Option("--ep", help="expert-parallel ranks (processes)")] = 1,
    host: Annotated[str, typer.Option(help="bind address (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8000,
    token_file: TokenFile = None,
    weights: Annotated[str | None, typer.Option(help="weights to start from: a Kimi checkpoint folder (K3 or "
                                                     "Kimi-Linear layout; its config.json sets the model) or a "
                                                     ".safetensors file under k3-mini's own names")] = None,
    seed: Annotated[int, typer.Option(help="initialisation seed when no weights are given")] = 0,
    max_batch: Annotated[int, typer.Option(help="most sequences in the running batch")] = 32,
    max_context: Annotated[int, typer.Option(help="context length (prompt + completion tokens)")] = 4096,
    device: Annotated[str, typer.Option(help="cpu, or cuda (one GPU per EP rank, NCCL)")] = "cpu",
    prefix_cache_mb: Annotated[int, typer.Option(help="memory for kept prefix states (0: no prefix reuse)")] = 256,
    echo: Annotated[Path | None, typer.Option(help="append a JSON line per finished sequence to this file: the "
                                                   "engine's own record of its prompt ids, sampled ids and "
                                                   "logprobs, for audits of what a client recorded")] = None,
) -> None:
    """Start the policy server (FastAPI + uvicorn)."""
    try:
        import uvicorn

        from policy.config import preset as get_preset
        from policy.engine import Engine
        from policy.server import create_app
        from policy.server.echo import Echo
        from policy.tokenizer import load_tokenizer
    except ImportError as e:
        print(f"error: the policy needs torch, tokenizers and FastAPI ({e}); pip install -e '.[policy]' in the checkout",
              file=sys.stderr)
        raise typer.Exit(2) from None

    secret = read_token(token_file)
    if secret is None:
        secret = secrets.token_urlsafe(32)
        print(f"policy token: {secret}", file=sys.stderr)
    tok = load_tokenizer()
    cfg = get_preset(preset, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                     pad_token_id=tok.pad_id)
    if weights is not None and Path(weights).is_dir():
        from policy.hf_format import check_vocab, read_config
        cfg = read_config(Path(weights))[0]
        check_vocab(cfg, tok.vocab_size)  # a checkpoint brings its weights, never its tokenizer
    engine = Engine(cfg, tok, ep_size=ep, seed=seed, weights=weights, max_batch=max_batch,
                    max_context=max_context, device=device, prefix_cache_bytes=prefix_cache_mb << 20)
    try:
        # proxy_headers off: a client is who its connection is, never what an X-Forwarded-For says (policy.authlimit)
        uvicorn.run(create_app(engine, secret, preset, echo=Echo(echo) if echo is not None else None), host=host,
                    port=port, log_level="warning", proxy_headers=False)
    finally:
        engine.close()


@app.command()
def verify(
    url: Annotated[str, typer.Argument(help="the endpoint's base URL, e.g. http://127.0.0.1:8000")],
    token_file: TokenFile = None,
    model: Annotated[str | None, typer.Option(help="model to check (default: the first the endpoint lists)")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizers JSON of the model (default: k3-mini's)")] = None,
    tolerance: Annotated[float, typer.Option(help="largest logprob difference allowed, in nats")] = 0.02,
    timeout: Annotated[float, typer.Option(help="seconds per request")] = 120.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Check a policy endpoint before rollouts use it: PASS / FAIL / SKIP per check; exit 1 on any FAIL."""
    import asyncio
    import json

    try:
        from policy.tokenizer import K3Tokenizer
        from policy.verify import print_report
        from policy.verify import verify as run_verify
    except ImportError as e:
        print(f"error: verify needs tokenizers and httpx ({e}); pip install -e '.[policy]' in the checkout", file=sys.stderr)
        raise typer.Exit(2) from None
    secret = read_token(token_file)
    tok = None
    if tokenizer is not None:
        from tokenizers import Tokenizer

        tok = K3Tokenizer(Tokenizer.from_file(str(tokenizer)))
    report = asyncio.run(run_verify(url, secret, model, tokenizer=tok, tolerance=tolerance, timeout=timeout))
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def export(
    weights: Annotated[str, typer.Argument(help="a .safetensors file under k3-mini's own names, or a Kimi folder")],
    out: Annotated[Path, typer.Argument(help="the checkpoint folder to write (replaced atomically)")],
    preset: Annotated[str, typer.Option(help="the model preset the .safetensors file was trained with")] = "k3-mini",
    model_config_file: Annotated[Path | None, typer.Option("--model-config", help="or a JSON file of its K3Config "
                                                           "fields (as agentenv train --model-config)")] = None,
) -> None:
    """Write weights as a checkpoint folder in the Kimi family's own Hugging Face layout (sharded safetensors under
    the on-disk names K3's loaders read, the index, config.json, k3-mini's tokenizer): mlx-lm's kimi_k3 loads it
    (and, with K3's parts off, transformers' kimi_linear); vLLM and SGLang read this layout, not run here."""
    from policy.config import model_config
    from policy.hf_format import load_state, read_config, save_model

    cfg = read_config(Path(weights))[0] if Path(weights).is_dir() else model_config(preset, model_config_file)
    print(save_model(load_state(weights, cfg), cfg, out))


@app.command()
def info(
    preset: Annotated[str, typer.Option(help="model preset")] = "k3-mini",
    k3_config: Annotated[Path | None, typer.Option(help="a K3 config.json")] = None,
) -> None:
    """Print a model's parameter counts (a K3 config.json is built on the meta device)."""
    import torch

    from policy.config import from_k3_json
    from policy.config import preset as get_preset
    from policy.model import K3Model, param_counts

    cfg = from_k3_json(k3_config) if k3_config else get_preset(preset)
    with torch.device("meta"):
        counts = param_counts(K3Model(cfg))
    for k, v in counts.items():
        print(f"{k}: {v / 1e9:.2f}B")


if __name__ == "__main__":
    app()
