"""The trajectory viewer's pages and routes (their data: ``trainer.viewer.data``), and ``agentenv view RUN``.

Served two ways, under the same paths (``/console/runs/...``): by ``agentenv view RUN`` (a server of its own on
127.0.0.1 with a token it generates, or ``--token-file``) and inside ``agentenv serve --runs DIR``'s console. Both
use the console's login, session cookie, headers (its CSP) and static route (``agentenv.server.console_auth``): the
pages are plain HTML in ``static/`` beside this module, and ``viewer.js`` sets every run-made text with
``textContent``. ``agentenv view`` itself is ``trainer.viewer.cli`` (light, so that ``agentenv --help`` stays quick).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse

from agentenv import errors
from agentenv.server import console_auth as console
from rollout import trajectory as tj
from trainer.viewer import data as viewer
from trainer.viewer import runs as viewer_runs

STATIC = Path(__file__).with_name("static")  # the viewer's pages, script and style
PAGES = {"runs": "runs.html", "run": "run.html", "episode": "episode.html", "group": "group.html",
         "searches": "searches.html", "metrics": "metrics.html"}

router = APIRouter(prefix=console.PREFIX, include_in_schema=False)


def install(app: FastAPI, root: str | Path, mode: str = "serve") -> None:
    """Serve the viewer over the runs under ``root`` on ``app`` (before the console's own pages: its
    ``/console/{page}`` would take ``/console/runs``)."""
    folder = Path(root)
    if not folder.is_dir():
        raise ValueError(f"--runs {folder}: not a folder (give the folder that holds the run folders)")
    app.state.viewer_root, app.state.viewer_mode = folder, mode
    console.serve_static(app, STATIC)
    app.state.console_links = [*getattr(app.state, "console_links", ()), (f"{console.PREFIX}/runs", "Runs")]
    app.include_router(router)


def create_app(root: str | Path, token: str) -> FastAPI:
    """``agentenv view``'s app: the viewer alone, behind the console's login with ``token``."""
    if not token:
        raise ValueError("the viewer needs a token")
    app = FastAPI(title="agentenv view", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.token = token
    install(app, root, mode="view")
    console.serve_login(app)

    @app.get("/", include_in_schema=False)
    @app.get(f"{console.PREFIX}/", include_in_schema=False)
    def home() -> Response:
        return RedirectResponse(f"{console.PREFIX}/runs", 303, headers=console.HEADERS)

    return app


# --- helpers ----------------------------------------------------------------------------------------------------


@functools.cache
def _tokenizer() -> Any:
    from rollout.agent import LocalTokenizer

    return LocalTokenizer()


def _decode(ids: list[int]) -> str:
    return str(_tokenizer().decode(ids))


def _error(e: Exception) -> Response:
    code = 400 if isinstance(e, viewer_runs.BadViewerRequest) else 404 if isinstance(e, viewer_runs.RunNotFound) else 422
    return JSONResponse(errors.to_wire(e), code, headers=console.HEADERS)


def _answer(request: Request, make: Any) -> Response:
    """``make()``'s data as JSON to a logged-in browser; the viewer's typed errors as 4xx."""
    if not console.logged_in(request):
        return console.unauthorized()
    try:
        return JSONResponse(make(), headers=console.HEADERS)
    except (viewer_runs.BadViewerRequest, viewer_runs.RunNotFound, tj.TrajectoryError) as e:
        return _error(e)


def _page(request: Request, page: str, run: str | None = None) -> Response:
    if not console.logged_in(request):
        return RedirectResponse(f"{console.PREFIX}/login", 303, headers=console.HEADERS)
    if run is not None:
        try:
            if viewer_runs.checked_name(run, "run") not in viewer_runs.list_runs(_root(request)):
                raise viewer_runs.RunNotFound(f"no run {run!r} under the viewer's folder", fix="pick one from the runs page")
        except (viewer_runs.BadViewerRequest, viewer_runs.RunNotFound) as e:
            return _error(e)
    return console.console_page(request, PAGES[page], folder=STATIC)  # the console's bar, with its links


def _root(request: Request) -> Path:
    root: Path = request.app.state.viewer_root
    return root


def _run(request: Request, name: str) -> viewer_runs.Run:
    return viewer_runs.load(_root(request), name)


# --- pages ------------------------------------------------------------------------------------------------------


@router.get("/runs")
def runs_page(request: Request) -> Response:
    return _page(request, "runs")


@router.get("/runs/{run}")
def run_page(request: Request, run: str) -> Response:
    return _page(request, "run", run)


@router.get("/runs/{run}/episodes/{episode_id}")
def episode_page(request: Request, run: str, episode_id: str) -> Response:
    return _page(request, "episode", run)


@router.get("/runs/{run}/groups/{group_id}")
def group_page(request: Request, run: str, group_id: str) -> Response:
    return _page(request, "group", run)


@router.get("/runs/{run}/searches")
def searches_page(request: Request, run: str) -> Response:
    return _page(request, "searches", run)


@router.get("/runs/{run}/metrics")
def metrics_page(request: Request, run: str) -> Response:
    return _page(request, "metrics", run)


# --- what they show ---------------------------------------------------------------------------------------------


@router.get("/api/runs")
def runs(request: Request) -> Response:
    """The runs under the viewer's folder; ``mode`` says whether the sandbox console is there too."""
    return _answer(request, lambda: {"mode": request.app.state.viewer_mode, "runs": [
        viewer_runs.brief(name, path) for name, path in viewer_runs.list_runs(_root(request)).items()]})


@router.get("/api/runs/{run}/episodes")
def episodes(request: Request, run: str) -> Response:
    return _answer(request, lambda: viewer.episodes(_run(request, run), dict(request.query_params)))


@router.get("/api/runs/{run}/episodes/{episode_id}")
def episode(request: Request, run: str, episode_id: str) -> Response:
    from rollout.cli import _tool_calls, split_messages

    return _answer(request, lambda: viewer.episode(_run(request, run), episode_id, _decode, _tool_calls,
                                                   split_messages))


@router.get("/api/runs/{run}/groups/{group_id}")
def group(request: Request, run: str, group_id: str) -> Response:
    from rollout.cli import _tool_calls

    return _answer(request, lambda: viewer.group(_run(request, run), group_id, _decode, _tool_calls))


@router.get("/api/runs/{run}/searches")
def searches(request: Request, run: str) -> Response:
    return _answer(request, lambda: viewer.searches(_run(request, run)))


@router.get("/api/runs/{run}/metrics")
def metrics(request: Request, run: str) -> Response:
    return _answer(request, lambda: viewer.metrics(_run(request, run)))
