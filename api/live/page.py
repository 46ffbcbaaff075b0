"""The live page at `GET /`: static HTML, CSS and JavaScript shipped inside the package (no CDN, no build step).

The page and its files carry no data, so they are served without the API key (see `api.apps.serve`): the page asks
for the key and sends it with its own requests (the event stream and the completions), which the key protects.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from api.protocol.errors import APIError

STATIC_DIR = Path(__file__).with_name("static")
# Only these files are served, by name: nothing else under the package can be reached through the route.
_MEDIA_TYPES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Exact paths, not a `/static/` prefix: `compare --modes static` serves that mode's API under `/static/...`.
FILE_PATHS = frozenset(f"/static/{name}" for name in _MEDIA_TYPES)
# The paths an API key does not guard: /health, and the page and its files (they hold no data; the page asks for the
# key itself).
OPEN_PATHS = frozenset({"/health", "/", *FILE_PATHS})
# no-cache: a browser revalidates (ETag), so a new version of the page shows on its next load.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


async def index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_HEADERS)


async def static_file(request: Request) -> Response:
    """`GET /static/{name}`: one of the page's files (routed by FILE_PATHS)."""
    name = request.url.path.rsplit("/", 1)[-1]
    media_type = _MEDIA_TYPES.get(name)
    if media_type is None:
        raise APIError(404, f"no route for GET {request.url.path}")
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers=_HEADERS)
