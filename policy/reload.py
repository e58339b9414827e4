"""Making a running engine load a pushed checkpoint folder, through each engine's own reload route, and recording
the version it now serves. One place for the requests: the trainer's weight sync and ``policy.engines`` both call
``reload``.

The requests follow the engines' own request schemas, read from their released sources (the versions below; the
unit test writes each schema as a strict model and runs the requests against a real loopback server enforcing it):

    ours     POST /update_weights             {"path": DIR, "mode": "drain" | "abort"} -> {"ok", "weight_version": N}
    SGLang   POST /update_weights_from_disk   {"model_path": DIR, "weight_version": "N", "abort_all_requests": bool}
                                              -> {"success", "message", "num_paused_requests"} (400 when refused)
             GET  /model_info                 -> {..., "weight_version": "N"}      (the version it now serves)
    vLLM     POST /pause?mode=wait|abort      -> {"status": "paused"}   (drains or aborts; clears the prefix cache)
    (dev     POST /collective_rpc             {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
     mode)                                    -> {"results": [null, ...]}  (one per worker) or an empty 200
             POST /update_weight_version      {"new_version": "N"} -> {"success": true, "new_version": "N"}
             POST /resume                     -> {"status": "resumed"}  (always, also after a failed reload)
             GET  /weight_info                -> {"weight_version": "N"}

vLLM serves those routes only with ``VLLM_SERVER_DEV_MODE=1`` (``policy.engines.vllm_command`` sets it); its
``/collective_rpc`` takes string kwargs only, so the folder is passed as a string. Both engines keep the version
we give them (our trainer's step), and we read it back: a push whose version the engine does not report is an
error. Every request has a deadline; one that passes raises ``ReloadTimeout`` instead of waiting forever.
"""

from __future__ import annotations

from typing import Literal, cast

import httpx

VLLM_VERSION = "0.33.0"
VLLM_SCHEMA_SOURCES = ("vllm/entrypoints/serve/dev/rpc/api_router.py (/collective_rpc)",
                       "vllm/entrypoints/rl/online/api_router.py (/pause, /resume, /update_weight_version, "
                       "/weight_info)",
                       "vllm/v1/worker/gpu_model_runner.py (reload_weights(weights_path=...))")
SGLANG_VERSION = "0.5.23"
SGLANG_SCHEMA_SOURCES = ("sglang/srt/managers/io_struct.py (UpdateWeightFromDiskReqInput, "
                         "UpdateWeightFromDiskReqOutput)",
                         "sglang/srt/entrypoints/http_server.py (/update_weights_from_disk, /model_info)")

KINDS = ("agentenv", "sglang", "vllm")
Mode = Literal["drain", "abort"]
JSON = dict[str, object]
VLLM_PAUSE = {"drain": "wait", "abort": "abort"}   # our sync mode -> vLLM's pause mode


class ReloadError(RuntimeError):
    """An engine did not load the pushed weights (it answered an error, refused them, or reports another version)."""


class ReloadTimeout(ReloadError, TimeoutError):
    """An engine gave no answer before the deadline."""


class _Engine:
    """One engine's base URL, kind, key and deadline: every request goes through ``call``."""

    def __init__(self, client: httpx.Client, url: str, kind: str, timeout: float, api_key: str | None) -> None:
        self.client, self.url, self.kind, self.timeout = client, url.rstrip("/"), kind, timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def call(self, method: str, route: str, body: JSON | None = None, params: dict[str, str] | None = None) -> JSON:
        where = f"{self.kind} at {self.url}: {method} {route}"
        try:
            r = self.client.request(method, self.url + route, json=body, params=params, headers=self.headers,
                                    timeout=self.timeout)
        except httpx.TimeoutException as e:
            raise ReloadTimeout(f"{where} gave no answer within the {self.timeout:g}s deadline; the engine may still "
                                "be loading: look at its log, or give the sync a longer timeout") from e
        except httpx.HTTPError as e:
            raise ReloadError(f"{where} failed: {type(e).__name__}: {e}; is the engine up at that address?") from e
        data = _json(r)
        if r.status_code >= 300 or data.get("success") is False:
            error = data.get("error")
            detail = (data.get("message") or (error.get("message") if isinstance(error, dict) else error)
                      or data.get("detail") or r.text[:300])
            raise ReloadError(f"{where} answered HTTP {r.status_code}: {detail}")
        return data

    def served_version(self, route: str, sent: int) -> int:
        """The version the engine reports (``GET route``'s ``weight_version``), which must be the one we sent."""
        got = self.call("GET", route).get("weight_version")
        if got != str(sent):
            raise ReloadError(f"{self.kind} at {self.url} reports weight version {got!r} after loading version "
                              f"{sent}: another client may be pushing weights to it")
        return sent


def _json(r: httpx.Response) -> JSON:
    if not r.content:
        return {}
    try:
        data = r.json()
    except ValueError:
        return {}
    return cast(JSON, data) if isinstance(data, dict) else {}


def reload(client: httpx.Client, url: str, kind: str, path: str, version: int, mode: Mode = "drain",
           timeout: float = 600.0, api_key: str | None = None) -> int:
    """Have the engine of ``kind`` at ``url`` load the checkpoint folder ``path`` as weight version ``version``
    (SGLang and vLLM keep it; ours counts its own loads) and return the version it now reports."""
    if kind not in KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; use one of {', '.join(KINDS)}")
    if mode not in VLLM_PAUSE:
        raise ValueError(f"unknown sync mode {mode!r}; use drain or abort")
    engine = _Engine(client, url, kind, timeout, api_key)
    if kind == "agentenv":
        got = engine.call("POST", "/update_weights", {"path": path, "mode": mode}).get("weight_version")
        if not isinstance(got, int):
            raise ReloadError(f"agentenv at {url}: /update_weights answered no weight_version (got {got!r})")
        return got
    if kind == "sglang":
        engine.call("POST", "/update_weights_from_disk",
                    {"model_path": path, "weight_version": str(version), "abort_all_requests": mode == "abort"})
        return engine.served_version("/model_info", version)
    engine.call("POST", "/pause", params={"mode": VLLM_PAUSE[mode]})
    try:
        engine.call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        engine.call("POST", "/update_weight_version", {"new_version": str(version)})
    except ReloadError as e:
        try:
            engine.call("POST", "/resume")
        except ReloadError as again:
            raise ReloadError(f"{e}; and it stays paused: {again}") from e
        raise
    engine.call("POST", "/resume")
    return engine.served_version("/weight_info", version)
