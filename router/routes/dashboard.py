"""``/dashboard`` (the page and its script: no data, open) and ``/dashboard/state`` (the data: behind the API key
where one is set); see ``router.dashboard``."""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, Response

from ..dashboard.snapshot import Window, snapshot
from .state import RouterState, router_state

routes = APIRouter()


def _file(name: str) -> str:
    return resources.files("router.dashboard").joinpath(name).read_text(encoding="utf-8")


@routes.get("/dashboard", response_class=HTMLResponse)
async def page():
    return HTMLResponse(_file("page.html"), headers={"Cache-Control": "no-store"})


@routes.get("/dashboard/page.js")
async def script():
    return Response(_file("page.js"), media_type="text/javascript", headers={"Cache-Control": "no-store"})


@routes.get("/dashboard/state")
async def state(st: RouterState = Depends(router_state)):
    if st.window is None:
        st.window = Window()
    return snapshot(st, st.window)
