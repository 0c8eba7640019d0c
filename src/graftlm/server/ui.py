"""The chat page at `/`: static files shipped in the package (static/), no build step.

The page is public (it holds no secret; the API calls it makes carry the key the user enters).
Only the files listed here are served, each with its type, and the page may load nothing but
this server's own files (Content-Security-Policy).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from graftlm.server.state import ApiError

STATIC = Path(__file__).with_name("static")
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> Response:
    kind = FILES.get(name)
    if kind is None:
        raise ApiError(404, f"GET /ui/{name[:100]}: no such file of the chat page", "not_found")
    return Response((STATIC / name).read_bytes(), media_type=kind, headers=_HEADERS)


@router.get("/")
async def page() -> Response:
    return _file("index.html")


@router.get("/ui/{name}")
async def asset(name: str) -> Response:
    return _file(name)
