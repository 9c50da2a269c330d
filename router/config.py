from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields

from .disagg import DisaggPolicy
from .policy import POLICIES
from .warmup import MODES as WARM_MODES


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)
    policy: str = "least_outstanding"
    kv_weight: float = 0.5
    tokenizer: str = ""
    first_timeout_s: float = 300.0
    token_timeout_s: float = 60.0
    stall_timeout_s: float = 30.0  # a request with no word from its worker for this long fails (0: never; router.waits)
    rebalance: bool = False  # move decoding requests off pressed decode workers (router.rebalance)
    roles: str = "fixed"  # fixed | auto: mixed workers' roles follow the load (router.role_control)
    roles_profile: str = ""  # auto: an engine profile; the split the planner's model serves best (router.role_plan)
    slo_ttft_ms: float = 2000.0  # the SLOs the role plan scores splits against
    slo_tpot_ms: float = 0.0
    heartbeat_s: float = 0.25
    stale_after_s: float = 1.0  # no pong for this long: out of the picks
    dead_after_s: float = 3.0  # no pong for this long: the requests it owns fail (and are retried)
    retries: int = 2  # attempts after the first for a request whose client has seen at most the first token
    retry_wait_s: float = 3.0  # a retry waits this long at most for a worker in the picks (else the error stands)
    max_queue: int = 256
    queue_timeout_s: float = 30.0
    max_body_bytes: int = 8 << 20
    disagg: str = "always"  # always | never | auto: where prompts are prefilled (router.disagg)
    disagg_local_tokens: int = 512  # auto: uncached prompts of at most this many tokens prefill on decode
    disagg_prefill_queue: int = 4  # auto: prompts in flight on every prefill worker that count as busy (no times)
    disagg_prefill_wait_ms: float = 500.0  # auto: a prompt's estimated wait on every prefill worker that is busy
    warm_pairs: str = "auto"  # auto | always | never: a request through each prefill -> decode pair first (router.warmup)
    workers_file: str = ""  # JSON {"prefill": [...], "decode": [...], "colocated": [...]}, re-read every second

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} not in {sorted(POLICIES)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.stall_timeout_s < 0:
            raise ValueError("stall_timeout_s must be >= 0 (0 turns the stall watchdog off)")
        if self.retries < 0 or self.retry_wait_s < 0:
            raise ValueError("retries and retry_wait_s must be >= 0")
        if not 0 < self.heartbeat_s < self.stale_after_s <= self.dead_after_s:
            raise ValueError("need 0 < heartbeat_s < stale_after_s <= dead_after_s")
        if self.kv_weight < 0:
            raise ValueError("kv_weight must be >= 0")
        if self.max_queue < 0 or self.queue_timeout_s <= 0:
            raise ValueError("max_queue must be >= 0 and queue_timeout_s > 0")
        self.disagg_policy()  # raises if invalid
        if self.roles not in ("fixed", "auto"):
            raise ValueError(f"roles {self.roles!r} not in ('fixed', 'auto')")
        if self.roles_profile and (self.roles != "auto" or self.slo_ttft_ms <= 0 or self.slo_tpot_ms <= 0):
            raise ValueError("roles_profile needs roles auto and positive slo_ttft_ms and slo_tpot_ms")
        if self.warm_pairs not in WARM_MODES:
            raise ValueError(f"warm_pairs {self.warm_pairs!r} not in {WARM_MODES}")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("give either colocated workers or prefill+decode workers, not both")
        if not self.colocated and not (self.prefill or self.disagg != "always") and not self.workers_file:
            raise ValueError("need at least one prefill worker (or --disagg auto|never), or colocated workers")
        if not self.colocated and not self.decode and not self.workers_file:
            raise ValueError("need at least one decode worker (or colocated workers)")
        for addr in self.prefill + self.decode + self.colocated:
            if not addr.startswith("tcp://"):
                raise ValueError(f"worker address {addr!r} must look like tcp://host:port")

    def disagg_policy(self) -> DisaggPolicy:
        return DisaggPolicy(self.disagg, self.disagg_local_tokens, self.disagg_prefill_queue,
                            self.disagg_prefill_wait_ms)

    @classmethod
    def from_toml(cls, path: str, **overrides) -> "RouterConfig":
        with open(path, "rb") as f:
            data = tomllib.load(f).get("router", {})
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown router settings in {path}: {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v not in (None, [], "")})
        return cls(**data)
