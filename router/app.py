"""The router's FastAPI application: its state (workers, service, admission, metrics), the lifespan that
connects to the workers and runs the periodic work (admission wake-ups, expired waits, membership, the pairs'
warm-up), the API-key
dependency and the route modules of ``router.routes``."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import zmq.asyncio
from fastapi import Depends, FastAPI

from .admission import Admission
from .config import RouterConfig
from .drain import Drains
from .role_control import RoleControl
from .role_plan import RolePlan
from .traffic import Traffic
from .roles import Roles
from .limits import BodyLimit
from .membership import Membership, worker_groups
from .metrics import Metrics
from .rebalance import Rebalancer
from .routes import admin, dashboard, errors, generation, status
from .routes.state import RouterState, check_key
from .service import Service
from .warmup import PairWarmer
from .workers import PICK_WAIT_S

log = logging.getLogger(__name__)
TICK_S = 0.2  # admission wake-ups, queue gauge, expired waits


def make_state(cfg: RouterConfig, inboxes: dict, token: bytes | None, api_key: str | None) -> RouterState:
    metrics, groups = Metrics(), worker_groups(cfg, inboxes, token)
    admission = Admission(cfg.max_queue, cfg.queue_timeout_s, pick_wait_s=max(PICK_WAIT_S, cfg.retry_wait_s))
    service = Service(groups, metrics, admission, cfg.first_timeout_s, cfg.token_timeout_s,
                      kv_aware=cfg.policy == "kv_aware", tokenizer=cfg.tokenizer or None, retries=cfg.retries,
                      retry_wait_s=cfg.retry_wait_s, disagg=cfg.disagg_policy(),
                      stall_timeout_s=cfg.stall_timeout_s, count_prompts=cfg.roles == "auto")
    service.inboxes = inboxes
    service.warmer = PairWarmer(service, groups, cfg.warm_pairs)
    drains = Drains(service, groups)
    return RouterState(cfg, service, metrics, admission, groups, api_key, drains=drains, roles=Roles(drains, metrics),
                       traffic=Traffic() if cfg.roles_profile else None)


def lifespan_of(st: RouterState, membership: Membership):
    @asynccontextmanager
    async def lifespan(app):
        ctx = zmq.asyncio.Context()
        clients = [c for group in st.groups.values() for c in group.clients]
        for client in clients:
            client.start(ctx)
        tasks = [asyncio.create_task(tick(st)), asyncio.create_task(st.service.warmer.run())]
        if st.cfg.rebalance:
            tasks.append(asyncio.create_task(Rebalancer(st.service, st.groups).run()))
        if st.cfg.roles == "auto":
            tasks.append(asyncio.create_task(RoleControl(st.roles, st.groups, st.cfg.disagg_policy(), plan_of(st)).run()))
        if st.cfg.workers_file:
            tasks.append(asyncio.create_task(membership.watch(ctx)))
        yield
        for task in tasks:
            task.cancel()
        for group in st.groups.values():
            for client in group.clients:
                client.close()
        ctx.term()
    return lifespan


def plan_of(st: RouterState) -> RolePlan | None:
    """``--roles-profile``'s plan, over the router's traffic and SLOs (None without a profile)."""
    cfg = st.cfg
    if not cfg.roles_profile:
        return None
    local = cfg.disagg_local_tokens if cfg.disagg == "auto" else None
    return RolePlan(cfg.roles_profile, st.traffic, cfg.slo_ttft_ms, cfg.slo_tpot_ms, local, st.metrics)


async def tick(st: RouterState) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        st.admission.wake()
        st.metrics.queue.set(st.admission.queued)
        st.service.waits.expire()


def create_app(cfg: RouterConfig, token: bytes | None = None, api_key: str | None = None) -> FastAPI:
    """``token``: the cluster token for worker connections; ``api_key``: required as ``Authorization: Bearer``."""
    inboxes: dict = {}
    st = make_state(cfg, inboxes, token, api_key)
    membership = Membership(cfg, st.groups, inboxes, token)
    app = FastAPI(title="pdserve router", lifespan=lifespan_of(st, membership), dependencies=[Depends(check_key)])
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.state.router, app.state.service, app.state.metrics = st, st.service, st.metrics
    errors.install(app)
    app.include_router(generation.routes)
    app.include_router(status.routes)
    app.include_router(admin.routes)
    app.include_router(dashboard.routes)
    return app
