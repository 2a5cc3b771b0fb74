"""The page at /: a chat with the model and a view inside it, plain HTML, CSS and JavaScript from static/ (no build
step, nothing fetched from elsewhere), which speaks to the server through its documented HTTP API alone.

The page and its files are served without the API key: they hold no secret, and the page asks for the key (kept
in the browser's localStorage) to send with its API calls, which need it as any client's do.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")


async def index(request):
    return FileResponse(STATIC / "index.html")


def serve(app: FastAPI) -> None:
    """Add the page to the app, outside its API routes' dependencies (the key)."""
    app.add_route("/", index, methods=["GET"])
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
