"""The gateway's live web dashboard: one HTML page, its script and stylesheet — no build step.

The page (``index.html``, ``app.js``, ``style.css`` beside this module, shipped as package data)
reads only the gateway's public endpoints: it polls ``/v1/swarm``, ``/v1/health`` and
``/v1/generations``, follows each running generation's ``/v1/generations/{id}/events`` and streams
a chat reply from ``/v1/chat/completions``. This module only serves the files (docs/dashboard.md);
they need no API key, and with ``--api-keys`` the page asks for one and signs in with it at
``/dashboard/key`` (``gateway.auth``): the gateway sets the ``meshnet_api_key`` cookie itself,
``HttpOnly; SameSite=Strict`` for its ``/v1/`` endpoints, and accepts it there from its own page only
(an ``EventSource`` cannot set headers, so a bearer token cannot do).
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from meshnet.errors import NotFound

__all__ = ["ASSETS", "routes"]

# The only files served under /dashboard/assets/, with their content types (text ones
# get ``charset=utf-8``): nothing else is reachable.
ASSETS = {
    "app.js": "text/javascript",
    "style.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
_INDEX = "index.html"
# The page loads nothing from elsewhere; node ids and model text are data, never markup or script.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


async def index(_: Request) -> Response:
    """The dashboard page (at ``/`` and ``/dashboard``)."""
    return Response(_read(_INDEX), media_type="text/html", headers=_HEADERS)


async def asset(request: Request) -> Response:
    """One of the page's own files, by name."""
    name = request.path_params["name"]
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no dashboard asset {name!r}")
    return Response(_read(name), media_type=media_type, headers=_HEADERS)


def routes() -> list[Route]:
    """The dashboard's routes, for the gateway's route list."""
    return [
        Route("/", index, methods=["GET"]),
        Route("/dashboard", index, methods=["GET"]),
        Route("/dashboard/assets/{name}", asset, methods=["GET"]),
    ]
