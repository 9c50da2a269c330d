"""What every route reads (``RouterState``, on ``app.state.router``) and the dependencies that hand it over."""
from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from ..admission import Admission
from ..config import RouterConfig
from ..errors import ApiError
from ..metrics import Metrics
from ..service import Service

OPEN_PATHS = ("/health", "/metrics", "/dashboard", "/dashboard/page.js")  # answered without the API key (the
# dashboard's page and script hold no data; its state needs the key)


@dataclass
class RouterState:
    cfg: RouterConfig
    service: Service
    metrics: Metrics
    admission: Admission
    groups: dict
    api_key: str | None = None
    ready_since: float | None = None  # when /health first answered ok (``pdserve up``: the cluster has started)
    drains: object = None  # router.drain.Drains
    roles: object = None  # router.roles.Roles
    window: object = None  # router.dashboard.snapshot.Window: the last minute's metric samples
    traffic: object = None  # router.traffic.Traffic: the last 20 s of requests, kept for --roles-profile only

    @property
    def mode(self) -> str:
        return "colocated" if self.service.colocated else "disaggregated"


def router_state(request: Request) -> RouterState:
    return request.app.state.router


def check_key(request: Request) -> None:
    """Every route but ``OPEN_PATHS`` needs ``Authorization: Bearer <key>`` when an API key is set."""
    key = router_state(request).api_key
    if key is None or request.url.path in OPEN_PATHS:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key")
