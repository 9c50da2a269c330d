"""Prometheus metrics of the router (one registry per app)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
PHASE_NAMES = ("d2h", "serialize", "wire", "deserialize", "convert", "h2d", "total")
WORKER_GAUGES = {
    "active": ("pdserve_worker_active_sequences", "Sequences a worker is generating"),
    "waiting": ("pdserve_worker_waiting_for_kv", "Decode requests waiting for their KV"),
    "queued": ("pdserve_worker_queued_prompts", "Prompts waiting in a prefill worker's queue"),
    "kv_reserved_bytes": ("pdserve_worker_kv_reserved_bytes", "KV budget a worker has reserved for its sequences"),
    "kv_budget_bytes": ("pdserve_worker_kv_budget_bytes", "A worker's KV memory budget"),
    "kv_pool_bytes_in_use": ("pdserve_worker_kv_buffer_bytes_in_use", "Transport buffer bytes holding received KV"),
    "kv_held_bytes": ("pdserve_worker_kv_held_bytes", "KV bytes a prefill worker holds until they are sent"),
    "restarts": ("pdserve_worker_restarts", "Times pdserve up restarted this worker after it died"),
    "prefix_prompt_tokens": ("pdserve_worker_prefix_prompt_tokens", "Prompt tokens a worker's engine started"),
    "prefix_cached_tokens": ("pdserve_worker_prefix_tokens_saved", "Prompt tokens a worker took from its prefix cache "
                             "instead of computing or receiving them"),
    "prefix_cached_blocks": ("pdserve_worker_prefix_cached_blocks", "Blocks in a worker's prefix cache"),
    "kv_skipped_bytes": ("pdserve_worker_kv_bytes_not_moved", "KV bytes a prefill worker did not send because the "
                         "decode worker held them"),
    "kv_pairs_aborted": ("pdserve_worker_kv_pairs_aborted", "NCCL pairs a worker's transport aborted (each costs the "
                         "next transfer between the two a new communicator)"),
}
TIER_GAUGES = {  # kvcache: each tier's blocks and movements, and the prompt tokens taken from each (docs/kv-tiers.md)
    f"{tier}_{what}": (f"pdserve_worker_kv_{tier}_{what}", f"A worker's KV {tier} tier: {doc}")
    for tier, whats in (("host", ("blocks", "capacity_blocks", "offloaded", "loaded", "dropped", "skipped_in_flight")),
                        ("disk", ("blocks", "capacity_blocks", "offloaded", "loaded", "dropped", "corrupt")),
                        ("pool", ("published", "unpublished", "loaded", "missing")))
    for what, doc in ((w, w.replace("_", " ")) for w in whats)}
TIER_GAUGES.update({f"prefix_{tier}_cached_tokens": (f"pdserve_worker_prefix_tokens_from_{tier}", f"Prompt tokens a "
                    f"worker loaded from its KV {tier} tier instead of computing them") for tier in ("host", "disk", "pool")})
WORKER_GAUGES.update(TIER_GAUGES)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token", ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between streamed tokens", ["mode"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "Time per output token after the first, per request choice",
                              ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "Request latency end to end", ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("pdserve_kv_transfer_phase_seconds", "KV transfer time by phase", ["transport", "phase"],
                               buckets=PHASE_BUCKETS, registry=r)
        self.stream = Histogram("pdserve_kv_transfer_stream_seconds", "KV transfer time hidden behind prefill compute "
                                "(overlap) and left after it (exposed)", ["transport", "part"], buckets=PHASE_BUCKETS,
                                registry=r)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes transferred", ["transport"], registry=r)
        self.tier_phase = Histogram("pdserve_kv_tier_phase_seconds", "A prompt's prefix out of the KV tiers and the "
                                    "cluster pool: fetch (found and fetched), load (copied into the GPU pool)",
                                    ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.rank_wire = Histogram("pdserve_kv_transfer_rank_wire_seconds", "KV wire time of each rank of a "
                                   "tensor-parallel decode group", ["transport", "rank"], buckets=PHASE_BUCKETS, registry=r)
        self.pp_hop = Histogram("pdserve_pp_hop_seconds", "Time a pipeline hop (hidden states from one stage to the "
                                "next) takes per step, by phase, averaged over a request's steps", ["role", "hop", "phase"],
                                buckets=PHASE_BUCKETS, registry=r)
        self.pp_hop_bytes = Counter("pdserve_pp_hop_bytes", "Hidden-state bytes moved between pipeline stages",
                                    ["role", "hop"], registry=r)
        self.requests = Counter("pdserve_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=r)
        self.retries = Counter("pdserve_request_retries", "Requests run again on other workers, by what failed",
                               ["reason"], registry=r)
        self.disagg = Counter("pdserve_disagg_requests", "Prompts prefilled on a prefill worker (remote) or on their "
                              "decode worker (local), by why (router.disagg)", ["where", "reason"], registry=r)
        self.stalled = Counter("pdserve_requests_stalled", "Requests failed by the stall watchdog (no word from their "
                               "worker for --stall-timeout), by the role waited on and where the request stood",
                               ["role", "state"], registry=r)
        self.migrations = Counter("pdserve_migrations", "Decoding requests moved to another decode worker, by why "
                                  "(drain, rebalance, admin) and how it went (moved, recomputed, failed)", ["reason", "outcome"],
                                  registry=r)
        self.role_changes = Counter("pdserve_role_changes", "Mixed workers' roles changed at runtime, by the new role",
                                    ["role"], registry=r)
        self.plan_within_slo = Gauge("pdserve_roles_plan_within_slo", "--roles-profile: the share of the last "
                                     "20 s of traffic the planner's model puts within the SLOs, by how many mixed "
                                     "workers prefill", ["prefilling"], registry=r)
        self.plan_goal = Gauge("pdserve_roles_plan_goal", "--roles-profile: the mixed workers prefilling that the "
                               "plan aims at (-1: no goal yet)", registry=r)
        self.migration_stall = Histogram("pdserve_migration_stall_seconds", "Time a moved request's tokens paused: "
                                         "from the source's last token to the target's first", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.errors = Counter("pdserve_errors", "Errors by kind", ["kind"], registry=r)
        self.tokens = Counter("pdserve_generated_tokens", "Completion tokens generated", registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests being served", registry=r)
        self.workers = Gauge("pdserve_healthy_workers", "Healthy workers by role", ["role"], registry=r)
        self.registrations = Gauge("pdserve_kv_memory_registrations", "Memory registrations a worker's transport has made",
                                   ["role", "worker"], registry=r)
        self.queue = Gauge("pdserve_admission_queue_depth", "Requests waiting for KV memory", registry=r)
        self.rejected = Counter("pdserve_admission_rejected", "Requests refused by admission control", ["status"], registry=r)
        self.worker = {k: Gauge(name, doc, ["role", "worker"], registry=r) for k, (name, doc) in WORKER_GAUGES.items()}
        self.hit_rate = Gauge("pdserve_worker_prefix_hit_rate", "Share of a worker's prompt tokens served from its "
                              "prefix cache", ["role", "worker"], registry=r)

    def observe_transfer(self, transport: str, phases: dict):
        for name in PHASE_NAMES:
            if name in phases:
                self.phase.labels(transport, name).observe(phases[name] / 1e3)
        self.kv_bytes.labels(transport).inc(phases.get("bytes", 0))
        ranks = phases.get("ranks")
        for rank, own in enumerate(ranks if isinstance(ranks, list) and len(ranks) <= 64 else []):
            if isinstance(own, dict) and isinstance(own.get("wire"), (int, float)):
                self.rank_wire.labels(transport, str(rank)).observe(own["wire"] / 1e3)

    def observe_tiers(self, timing: dict):
        for phase in ("fetch", "load"):
            if isinstance(timing.get(f"kv_tier_{phase}"), (int, float)):
                self.tier_phase.labels(phase).observe(timing[f"kv_tier_{phase}"] / 1e3)

    def observe_hops(self, hops: list):
        for h in hops:
            steps = max(1, h["steps"])
            for name in PHASE_NAMES:
                self.pp_hop.labels(h["role"], h["hop"], name).observe(h[name] / steps / 1e3)
            self.pp_hop_bytes.labels(h["role"], h["hop"]).inc(h["bytes"])

    def observe_stream(self, transport: str, stream: dict):
        for part in ("overlap", "exposed"):
            if isinstance(stream.get(part), (int, float)):
                self.stream.labels(transport, part).observe(stream[part] / 1e3)

    def observe_workers(self, groups: dict):
        for role, group in groups.items():
            self.workers.labels(role).set(len(group.healthy()))
            for c in group.clients:
                for key, gauge in self.worker.items():
                    if key in c.info:
                        gauge.labels(role, c.address).set(c.info[key])
                if c.info.get("prefix_prompt_tokens"):
                    self.hit_rate.labels(role, c.address).set(c.info.get("prefix_cached_tokens", 0)
                                                              / c.info["prefix_prompt_tokens"])
                if "kv_registrations" in c.info:
                    self.registrations.labels(role, c.address).set(c.info["kv_registrations"])
