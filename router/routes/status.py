"""``/v1/models``, ``/health`` (200 when a worker of every role a request needs is in the picks and the pairs
seen at start-up are warm (``router.warmup``; 503 with status ``warming`` until then), with what each worker last
reported and ``ready_since``, when it first answered 200) and ``/metrics`` (Prometheus)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .state import RouterState, router_state

routes = APIRouter()


@routes.get("/v1/models")
async def models(st: RouterState = Depends(router_state)):
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "pdserve"} for m in sorted(st.service.models())]
    return {"object": "list", "data": data}


def routed_keys(client) -> dict:
    """What the router knows of where the worker's prefixes live (the prefix-cache keys ``kv_aware`` weighs): in its
    GPU pool, in host memory, on disk, and those it put in the cluster-wide pool."""
    lower, disk = len(client.kv_lower), len(client.kv_disk)
    return {"router_keys_gpu": len(client.kv_keys) - lower, "router_keys_host": lower - disk, "router_keys_disk": disk,
            "router_keys_pooled": len(client.kv_pooled)}


@routes.get("/health")
async def health(st: RouterState = Depends(router_state)):
    workers = {role: [{"address": c.address, "healthy": c.healthy, "outstanding": c.outstanding,
                       "drain": c.drain_state, **c.info, **routed_keys(c)}
                      for c in g.clients] for role, g in st.groups.items() if g.clients}
    st.metrics.observe_workers(st.groups)
    ok, warm = st.service.ready(), st.service.warmer.status()
    problems = st.service.mismatches()
    status = "ok" if ok and warm["ready"] else "warming" if ok else "unavailable"
    if status == "ok" and st.ready_since is None:
        st.ready_since = time.time()
    return JSONResponse({"status": status, "mode": st.mode, "ready_since": st.ready_since, "workers": workers,
                         "pairs": warm,
                         **({"problems": problems} if problems else {}),
                         "stalled_after_s": st.cfg.stall_timeout_s, "older_than_stall": st.service.waits.stuck(),
                         "admission": {"queued": st.admission.queued, "in_flight": len(st.service.inboxes),
                                       "reserved": len(st.admission.reserved)}},
                        status_code=200 if status == "ok" else 503)


@routes.get("/metrics")
async def prom(st: RouterState = Depends(router_state)):
    st.metrics.observe_workers(st.groups)
    st.metrics.queue.set(st.admission.queued)
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
