"""The console's login: a page that takes the server's token and sets a session cookie, the sessions, and the
headers and static files every console page is served with (the console's pages, ``trainer.viewer.web``'s).

The cookie holds a random session id, never the token, scoped to ``/console`` (HttpOnly, SameSite=Strict); the
sessions live in this process (a restart logs everyone out). Every reply carries a CSP that runs this server's
own scripts only.

SameSite does not keep other pages of this host out: every port of 127.0.0.1 is one *site* to a browser, so a page
on another port (``agentenv view``'s, a sandbox's forwarded port, any local web app) gets the cookie sent with the
forms it posts here. So every request that changes state (login, logout, the console's actions) must come from the
console's own *origin*, scheme, host and port (``same_origin``). A wrong token at the login spends its sender's
budget of failed authentication (``policy.authlimit``), shared with the server's other checks.
"""

from __future__ import annotations

import html
import secrets
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse

from policy.authlimit import AuthFailures, Spent

PREFIX = "/console"
COOKIE = "agentenv_console"
SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 256  # the oldest session is dropped past this many logins
STATIC = Path(__file__).with_name("console_static")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
HEADERS = {  # on every console reply
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

BAR = "<nav></nav>"  # in every page: where its top bar goes (``top_bar``)

auth = APIRouter(prefix=PREFIX, include_in_schema=False)  # login, logout, scripts: every console page's


class Sessions:
    """The logged-in console sessions: random ids, each valid for SESSION_SECONDS (a restart logs everyone out)."""

    def __init__(self) -> None:
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()
        self.streams = 0

    def new(self) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            now = time.monotonic()
            self._expiry = {k: t for k, t in self._expiry.items() if t > now}
            while len(self._expiry) >= MAX_SESSIONS:
                del self._expiry[next(iter(self._expiry))]
            self._expiry[sid] = now + SESSION_SECONDS
        return sid

    def valid(self, sid: str | None) -> bool:
        with self._lock:
            return sid is not None and self._expiry.get(sid, 0.0) > time.monotonic()

    def end(self, sid: str | None) -> None:
        with self._lock:
            self._expiry.pop(sid or "", None)


def serve_login(app: FastAPI) -> None:
    """Give ``app`` (its state holding the token) the console's sessions and its login, logout and static routes;
    its budget of failed authentication too, unless the server already keeps one for its other checks."""
    app.state.console_sessions = Sessions()
    if not hasattr(app.state, "auth_failures"):
        app.state.auth_failures = AuthFailures()
    app.include_router(auth)


def sessions(request: Request) -> Sessions:
    found: Sessions = request.app.state.console_sessions
    return found


def logged_in(request: Request) -> bool:
    return sessions(request).valid(request.cookies.get(COOKIE))


def top_bar(request: Request) -> str:
    """The top bar of every page, the same everywhere: the links the app's parts added (``app.state.console_links``:
    pairs of path and label; the console's Sandboxes, Snapshots and Server, the viewer's Runs), the one the page
    is under marked, a place for a page's own links (``run-links``), log out, and the badge of the event stream
    (shown by the pages it feeds)."""
    links = getattr(request.app.state, "console_links", ())
    path = request.url.path
    under = [href for href, _ in links if path == href or path.startswith(href.rstrip("/") + "/")]
    here = max(under, key=len, default=None)
    items = "".join(' <a href="{}"{}>{}</a>'.format(html.escape(href), ' class="here"' if href == here else "",
                                                    html.escape(label)) for href, label in links)
    return (f'<nav><b>agentenv</b>{items} <span id="run-links"></span>\n<form method="post" action="{PREFIX}/logout">'
            '<button type="submit" id="logout">Log out</button></form>\n'
            '<span id="live" data-state="connecting" hidden>connecting</span></nav>')


def console_page(request: Request, name: str, folder: Path = STATIC) -> Response:
    """A page of the console (or of a package's ``folder``) with its top bar."""
    return page_file(name, replace=(BAR, top_bar(request)), folder=folder)


def page_file(name: str, status: int = 200, replace: tuple[str, str] | None = None, folder: Path = STATIC) -> Response:
    """A file of ``folder`` (the console's own, or the one a package added with ``serve_static``) with its headers."""
    text = (folder / name).read_text()
    if replace is not None:
        text = text.replace(*replace)
    return Response(text, status, headers=HEADERS, media_type=TYPES[Path(name).suffix])


def _origin(url: str) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) of a URL or an origin, the default port spelled out; None if it names none."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    return (parts.scheme, (parts.hostname or "").lower(), port) if parts.scheme and parts.hostname else None


def same_origin(request: Request) -> bool:
    """Whether the browser that sent ``request`` says it comes from the console's own origin (the scheme it was
    served on and its Host): ``Sec-Fetch-Site`` same-origin where sent (a browser's own word, which no page can
    forge; same-site is another port), and ``Origin`` and ``Referer`` naming this origin where sent (an Origin of
    null only beside Sec-Fetch-Site same-origin: a same-origin POST under the console's no-referrer policy may say
    null). A request that says none of these comes from no browser (curl, a script), which no page can make carry
    the session cookie."""
    own = _origin(f"{request.url.scheme}://{request.headers.get('host', '')}")
    site = request.headers.get("sec-fetch-site")
    if own is None or site not in (None, "same-origin"):
        return False
    origin = request.headers.get("origin")
    if origin is not None and not (origin == "null" and site == "same-origin") and _origin(origin) != own:
        return False
    referer = request.headers.get("referer")
    return referer is None or _origin(referer) == own


def forbidden(what: str) -> Response:
    """The refusal of a state-changing request that is not the console's own page's (``same_origin``)."""
    return JSONResponse({"error": "Forbidden", "message": f"{what} must come from the console's own page",
                         "fix": "use the console's page itself (the same scheme, host and port)", "id": None},
                        403, HEADERS)


def unauthorized() -> Response:
    return JSONResponse({"error": "Unauthorized", "message": "not logged in to the console",
                         "fix": f"log in at {PREFIX}/login with the server's token", "id": None}, 401, HEADERS)


# --- login ------------------------------------------------------------------------------------


@auth.get("/login")
def login_page() -> Response:
    return page_file("login.html")


@auth.post("/login")
async def login(request: Request) -> Response:
    """Check the token a login form sent (urlencoded ``token``); on a match, a session cookie and the console."""
    if not same_origin(request):
        return forbidden("a login")
    body = await request.body()
    given = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0].strip()
    failures: AuthFailures = request.app.state.auth_failures
    try:
        right = failures.matches(request.scope, given.encode(), request.app.state.token.encode())
    except Spent as e:
        return Response(str(e), 429, headers={**HEADERS, "Retry-After": str(e.seconds)}, media_type="text/plain")
    if not right:
        return page_file("login.html", 401, ('<p id="error" hidden>', '<p id="error">'))
    reply = RedirectResponse(f"{PREFIX}/", 303, headers=HEADERS)
    reply.set_cookie(COOKIE, sessions(request).new(), max_age=SESSION_SECONDS, path=PREFIX, httponly=True,
                     samesite="strict", secure=request.url.scheme == "https")
    return reply


@auth.post("/logout")
def logout(request: Request) -> Response:
    if not same_origin(request):
        return forbidden("a logout")
    sessions(request).end(request.cookies.get(COOKIE))
    reply = RedirectResponse(f"{PREFIX}/login", 303, headers=HEADERS)
    reply.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return reply


def serve_static(app: FastAPI, folder: Path) -> None:
    """Serve the scripts and styles of ``folder`` (a package's own pages, e.g. the trajectory viewer's) under
    ``/console/static/`` beside the console's; a name the console's folder has stays the console's."""
    app.state.console_static = (*getattr(app.state, "console_static", ()), folder)


@auth.get("/static/{name}")
def static(request: Request, name: str) -> Response:
    """The console's scripts and style (nothing secret: they hold no data), by name from the packages' folders only:
    the name must be one a folder lists, so no path reaches past them."""
    if Path(name).suffix in (".js", ".css"):
        for folder in (STATIC, *getattr(request.app.state, "console_static", ())):
            if name in {p.name for p in folder.iterdir() if p.is_file()}:
                return page_file(name, folder=folder)
    return Response("not found", 404, headers=HEADERS, media_type="text/plain")
