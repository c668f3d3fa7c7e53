"""The operator's page: ``GET /`` and its assets under ``/ui/``, static files shipped in the package.

One HTML page, its script and stylesheet (``static/``), no build step and nothing fetched from
elsewhere (it works offline). It reads only the public endpoints: ``/ready`` (every rank's load
progress), ``/info`` (the group, per rank memory and work), ``/metrics`` (live figures, diffed
between scrapes), and streams from ``/v1/chat/completions``. Charts are drawn by the page on a
canvas (a few lines; a charting library would be the largest file here). With ``--api-key`` the
page asks for the key and keeps it in the tab's sessionStorage only; only GET of the page and its
assets is open without a key (``server.http.guard``).
"""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse
from starlette.exceptions import HTTPException

STATIC = os.path.join(os.path.dirname(__file__), "static")
ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}


def build_ui_router() -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        with open(os.path.join(STATIC, "index.html"), encoding="utf-8") as f:
            return HTMLResponse(f.read(), headers={"Cache-Control": "no-cache"})

    @router.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise HTTPException(404, f"no asset {name}")
        return FileResponse(os.path.join(STATIC, name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    return router
