"""The bodies of E2B's control-plane requests (``control``), as the ``e2b`` SDK (2.x) sends them, camelCase or
snake_case: each is checked whole, and a key agentenv does not know is a 400 naming it, never ignored.

The network options are read here: ``allow_internet_access`` absent or true is a sandbox with network (E2B's
default), false one with loopback only; ``network.allowOut`` / ``denyOut`` are the outbound rules, and
``allow_internet_access: false`` with an ``allowOut`` list adds ``0.0.0.0/0`` to ``denyOut``, as E2B reads it.
What agentenv does not enforce (``dnsServers``, ``egressProxy``, per-host ``rules``, ``httpsPorts``, any other key)
or does not offer (``mcp``, ``iam``, ``volumeMounts``) is refused with a 400 that names it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentenv import netpolicy
from agentenv.api import MAX_FORK
from agentenv.server.e2b import ports
from agentenv.server.e2b.plane import E2BError

DEFAULT_TIMEOUT = 300  # seconds: E2B's default sandbox lifetime


class _Body(BaseModel):
    """A request body: a key it does not name is refused (400 naming it), never ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


_NOTHING: tuple[Any, ...] = (None, {}, [])  # an option sent with one of these asks for nothing (dnsServers aside)


class NetworkConfig(BaseModel):
    """E2B's ``SandboxNetworkConfig`` (create) and ``SandboxNetworkUpdateConfig`` (update), camelCase or snake_case;
    other keys are kept (``extra``) so that ``unenforced`` can name them."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    allow_out: list[str] | None = Field(None, alias="allowOut", max_length=netpolicy.MAX_ENTRIES)
    deny_out: list[str] | None = Field(None, alias="denyOut", max_length=netpolicy.MAX_ENTRIES)
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    # the Host header its ports' requests carry (``${PORT}``: the port); printable ASCII, no spaces
    mask_request_host: str | None = Field(None, alias="maskRequestHost", min_length=1, max_length=512,
                                          pattern=r"^[\x21-\x7e]+$")

    def unenforced(self) -> list[str]:
        """The options asked for that agentenv does not enforce: every key but an empty one and those it does
        (``dnsServers: []`` asks for no DNS server, which is not enforced either)."""
        return sorted(k for k, v in (self.model_extra or {}).items()
                      if k in ("dnsServers", "dns_servers") or not any(v == n for n in _NOTHING))

    def labels(self) -> dict[str, str]:
        """The sandbox labels that carry ``allowPublicTraffic`` and ``maskRequestHost`` (``ports`` reads them, on
        every request and after restarts; forks keep their parent's labels, so these too)."""
        out = {ports.PUBLIC_LABEL: "true"} if self.allow_public_traffic else {}
        if self.mask_request_host is not None:
            out[ports.MASK_LABEL] = self.mask_request_host
        return out

    def rules(self, internet: bool | None) -> tuple[list[str], list[str]]:
        """``(allow_out, deny_out)``: E2B's ``allow_internet_access: false`` is ``denyOut`` ``0.0.0.0/0``."""
        if bad := self.unenforced():
            raise E2BError(400, f"network option(s) {bad} are not enforced by agentenv: only allowOut, denyOut, "
                                "allowPublicTraffic and maskRequestHost are; leave the others out")
        allow, deny = list(self.allow_out or []), list(self.deny_out or [])
        if internet is False and netpolicy.ALL_TRAFFIC not in deny:
            deny.append(netpolicy.ALL_TRAFFIC)
        return allow, deny


class NetworkUpdate(NetworkConfig):
    allow_internet_access: bool | None = Field(None, alias="allowInternetAccess")

    def unenforced(self) -> list[str]:
        """As at create, and the two options E2B only takes at create (its update config has neither)."""
        fixed = [k for k, v in (("allowPublicTraffic", self.allow_public_traffic),
                                ("maskRequestHost", self.mask_request_host)) if v is not None]
        return fixed + super().unenforced()


class AutoResume(_Body):
    enabled: bool


class NewSandbox(_Body):
    template_id: str = Field(alias="templateID", min_length=1, max_length=256)
    timeout: int = Field(DEFAULT_TIMEOUT, ge=0, le=30 * 86400)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    auto_pause: bool | None = Field(None, alias="autoPause")
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(None, alias="autoResume")
    secure: bool | None = None  # E2B ignores it too: access to a sandbox always needs its token
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volume_mounts: list[dict[str, Any]] | None = Field(None, alias="volumeMounts")

    def on_expiry(self) -> str:
        """What the sandbox's timeout does ('kill', E2B's default, or 'pause' with ``autoPause``); a 400 for
        what agentenv does not offer rather than a sandbox that behaves otherwise."""
        unoffered = [k for k, v in (("mcp", self.mcp), ("iam", self.iam), ("volumeMounts", self.volume_mounts))
                     if v]
        if unoffered:
            raise E2BError(400, f"{unoffered} are not offered by agentenv (E2B cloud features): leave them out")
        if self.auto_resume is not None and self.auto_resume.enabled and not self.auto_pause:
            raise E2BError(400, "autoResume needs the timeout to pause the sandbox (lifecycle.on_timeout 'pause'): "
                                "a killed sandbox has nothing to resume")
        if self.auto_resume is not None and self.auto_resume.enabled and self.auto_pause_memory is False:
            raise E2BError(400, "autoResume cannot go with a filesystem-only pause (autoPauseMemory false): such a "
                                "sandbox boots afresh on Sandbox.connect, not on traffic")
        return "pause" if self.auto_pause else "kill"

    def network_asked(self) -> bool | dict[str, list[str]]:
        """``Sandbox.create``'s ``network``: True when neither is given (E2B's default is internet access), False
        for ``allow_internet_access: false`` without an ``allowOut`` list, else the rules."""
        allow, deny = (self.network or NetworkConfig.model_validate({})).rules(self.allow_internet_access)
        if self.allow_internet_access is False and not allow:
            return False
        return {"allow_out": allow, "deny_out": deny} if allow or deny else True


class Timeout(_Body):
    timeout: int | None = Field(None, ge=0, le=30 * 86400)


class ConnectBody(Timeout):
    memory: bool | None = None  # false: boot a paused sandbox afresh from its files (on_resume="reboot")


class Refresh(_Body):
    duration: int | None = Field(None, ge=0, le=30 * 86400)


class ForkBody(_Body):
    timeout: int | None = Field(None, ge=0, le=30 * 86400)
    count: int = Field(1, ge=1, le=MAX_FORK)


class SnapshotBody(_Body):
    name: str | None = Field(None, max_length=256)
    memory: bool | None = None


class PauseBody(_Body):
    memory: bool | None = None
    require_healthy_guest: bool | None = Field(None, alias="requireHealthyGuest")  # a pause always needs the keeper
