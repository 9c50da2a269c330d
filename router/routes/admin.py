"""``POST /admin/drain`` and ``POST /admin/undrain`` (``router.drain``): ``{"worker": ADDRESS, "force": false}``,
answered with the worker's drain state; ``POST /admin/role`` (``router.roles``): ``{"worker": ADDRESS, "role":
"prefill"|"decode"|"mixed", "force": false}``, answered with the role it has now. Behind the API key like every
route but ``/health`` and ``/metrics``."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict

from .state import RouterState, router_state

routes = APIRouter(prefix="/admin")


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker: str
    force: bool = False


class UndrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker: str


@routes.post("/drain")
async def drain(body: DrainRequest, st: RouterState = Depends(router_state)):
    return await st.drains.drain(body.worker, body.force)


@routes.post("/undrain")
async def undrain(body: UndrainRequest, st: RouterState = Depends(router_state)):
    return st.drains.undrain(body.worker)


class RoleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker: str
    role: str
    force: bool = False


@routes.post("/role")
async def role(body: RoleRequest, st: RouterState = Depends(router_state)):
    return await st.roles.set(body.worker, body.role, body.force)
