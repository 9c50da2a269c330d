"""What every worker process shares: a control server, an inbox drained by one
engine thread, ping/pong with the worker's description, reply routing by
request id back to the router connection that asked, and graceful shutdown.

Shutdown (SIGTERM/SIGINT): the worker announces ``draining`` to every router
it has heard from (an unsolicited ``pong``), keeps serving what it already
has until idle or ``drain_s`` passes, fails what is left with 503 and exits.
A second signal exits at once.

Routers ping every worker (``ping{t, every}``); a router not heard from for
``max(ROUTER_LOST_S, 4 x every)`` is gone (killed, or cut off): the requests
it asked for are aborted here, so their KV blocks come free, and a restarted
router starts as a new peer."""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time

from .muted import Muted
from .server import ControlServer

log = logging.getLogger(__name__)

MIN_DRAIN_S = 0.3
ROUTER_LOST_S = 5.0
PROGRESS_EVERY_S = 1.0  # a request's ``progress`` messages, at most this often (the router's stall watchdog)


class WorkerLoop:
    role = "worker"
    prefix_blocks = None  # the engine's BlockManager when it caches prefixes: its keys go to every router

    def __init__(self, host: str, port: int, drain_s: float = 20.0, token: bytes | None = None):
        self.inbox: queue.Queue = queue.Queue()
        self.server = ControlServer(host, port, self._on_message, token)
        self.reply_to: dict[str, bytes] = {}
        self.peers: set[bytes] = set()
        self.heard: dict[bytes, tuple[float, float]] = {}  # router identity -> (last message, silence that means lost)
        self._peers_checked = 0.0
        self.stopping = threading.Event()
        self.forced = threading.Event()
        self.drain_s = drain_s
        self.draining_since: float | None = None
        self.restarts = int(os.environ.get("PDSERVE_RESTARTS", "0") or 0)
        self._local = threading.local()
        self.progressed: dict[str, float] = {}  # rid -> when its last ``progress`` went out
        self.muted = Muted.from_env()

    def info(self) -> dict:
        return {"role": self.role}

    def describe(self) -> dict:
        out = {**self.info(), "draining": self.draining_since is not None, "restarts": self.restarts,
               "pid": os.getpid()}
        engine = getattr(self, "engine", None)
        group = getattr(engine, "group", None)
        stages = getattr(getattr(engine, "stage", None), "stages", None) or getattr(engine, "pipeline", None)
        if group is not None and group.size > 1 and stages is None:
            out.update(tp=group.size, rank_pids=[p.pid for p in group.procs.values()])
        if stages is not None:  # stage 0 of a pipeline: the others' processes and layers
            out.update(pp=len(stages.spans), pp_layers=[list(s) for s in stages.spans],
                       stage_pids=[p.pid for p in stages.procs.values()],
                       stage_hosts=getattr(stages, "hosts", None), pp_in_flight_max=self._most_in_flight(engine))
        return out

    @staticmethod
    def _most_in_flight(engine) -> int | None:
        """The most micro-batches a pipeline has had in flight at once (torch: the driver's; mlx: its batches')."""
        for holder in (getattr(engine, "stage", None), getattr(engine, "micro", None)):
            if getattr(holder, "most_in_flight", None) is not None:
                return holder.most_in_flight
        return None

    def _on_message(self, identity: bytes, msg: dict) -> None:
        every = msg.get("every") if msg["op"] == "ping" else None
        lost_after = max(ROUTER_LOST_S, 4 * every) if isinstance(every, (int, float)) else \
            self.heard.get(identity, (0.0, ROUTER_LOST_S))[1]
        self.heard[identity] = (time.monotonic(), lost_after)
        if msg["op"] == "ping":
            new = identity not in self.peers
            self.peers.add(identity)
            self.server.send(identity, "pong", info=self.describe(), t=msg.get("t"))
            if new and self.prefix_blocks is not None:  # sent by the engine thread, in order with the updates
                self.inbox.put({"op": "_kv_snapshot", "rid": "", "to": identity})
            return
        rid = msg.get("rid")
        if not rid:
            log.warning("dropping %s message without rid", msg["op"])
            return
        if msg["op"] == "abort":
            self.on_abort(rid)
        else:
            self.reply_to[rid] = identity
            self.muted.consider(rid, msg)
        self.inbox.put(msg)

    def watch_group(self, engine) -> None:
        """Fail and exit when a rank of ``engine``'s tensor-parallel group dies (nothing without TP)."""
        group = getattr(engine, "group", None)
        if group is not None and group.size > 1:
            group.on_lost = self._rank_lost
        stages = getattr(getattr(engine, "stage", None), "stages", None)
        if stages is not None:
            stages.on_lost = lambda stage, code: self._rank_lost(stage, code, "pipeline stage")

    def after_step_error(self) -> None:
        """A step failed: when a rank of this worker's group died, fail everything and exit (as the watcher does),
        rather than report the collective's error."""
        group = getattr(getattr(self, "engine", None), "group", None)
        if group is not None and group.size > 1:
            dead = dead_rank(group)
            if dead is not None:
                self._rank_lost(*dead)
        stages = getattr(getattr(getattr(self, "engine", None), "stage", None), "stages", None)
        if stages is not None:  # a hop fails a moment before the stage's exit is seen
            dead = dead_rank(stages)
            if dead is not None:
                self._rank_lost(*dead, "pipeline stage")

    def _rank_lost(self, rank: int, code, what: str = "tensor-parallel rank") -> None:
        """(Watcher thread) A rank of this worker's group (or a stage of its pipeline) exited: its collectives (hops)
        can only hang or fail now."""
        log.error("%s %d of this %s worker exited (code %s): failing %d requests and exiting",
                  what, rank, self.role, code, len(self.reply_to))
        self._give_up(f"{what} {rank} of the {self.role} worker died; it restarts",
                      "pp_stage_lost" if what == "pipeline stage" else "tp_rank_lost")

    def _rank_stuck(self, rank: int) -> None:
        """(A sender thread) A rank of this worker's group stopped answering for its KV pushes (``GroupPushes``)."""
        log.error("rank %d of this %s worker sent no report on its last KV pushes: stuck in a transfer; failing %d "
                  "requests and exiting", rank, self.role, len(self.reply_to))
        self._give_up(f"rank {rank} of the {self.role} worker is stuck in a KV transfer; it restarts", "tp_rank_lost")

    def _give_up(self, message: str, stage: str) -> None:
        """Out of every router's picks, every request failed (retryable), then exit 70 (``pdserve up`` restarts)."""
        self.draining_since = time.monotonic()  # out of every router's picks now, not when its pings go unanswered
        for identity in list(self.peers):
            self.server.send(identity, "pong", info=self.describe(), t=None)
        for rid in list(self.reply_to):
            self.fail(rid, 503, message, stage=stage)
        time.sleep(0.3)  # let the errors leave
        os._exit(70)

    def on_abort(self, rid: str) -> None:
        """(Control thread) An abort is on its way to the engine thread: stop what cannot wait for it."""

    def emit(self, rid: str, op: str, **fields) -> None:
        identity = self.reply_to.get(rid)
        if identity is None:
            return
        if op in ("done", "error"):
            self.reply_to.pop(rid, None)
        if op != "progress":
            self.progressed.pop(rid, None)
        if self.muted.drops(rid, op):
            return
        outbox = getattr(self._local, "outbox", None)
        if outbox is None:
            self.server.send(identity, op, rid=rid, **fields)
        else:
            outbox.setdefault(identity, []).append({"op": op, "rid": rid, **fields})

    def report_progress(self, out, waiting=()) -> None:
        """After a step: ``progress`` for the prompts it computed a chunk of without a token yet (``prefilling``) and
        for those still ``queued`` behind it (``waiting``: sequences), each at most every ``PROGRESS_EVERY_S``: the
        router's stall watchdog hears that they move (``router.waits``)."""
        now = time.monotonic()
        done = {id(tok.seq) for tok in out.tokens}
        for state, seqs in (("prefilling", [s for s in out.scheduled if id(s) not in done and not s.output_ids]),
                            ("queued", waiting)):
            for seq in seqs:
                if seq.rid in self.reply_to and now - self.progressed.get(seq.rid, 0.0) >= PROGRESS_EVERY_S:
                    self.progressed[seq.rid] = now
                    self.emit(seq.rid, "progress", state=state)

    def where_is(self, rid: str) -> str:
        """Where this worker's scheduler has request ``rid`` (logged when the router gives it up as stalled)."""
        scheduler = getattr(getattr(self, "engine", None), "scheduler", None)
        for name in ("waiting", "running"):
            for seq in list(getattr(scheduler, name, ())):
                if seq.rid == rid:
                    return (f"{name} in the scheduler: {seq.num_computed} of {len(seq.prompt_ids)} prompt tokens "
                            f"computed, {seq.num_output} output tokens, {seq.pending} on the device, finish "
                            f"{seq.finish_reason}")
        places = [name for name in ("live", "waiting", "held", "landing", "sending") if rid in getattr(self, name, {})]
        places += ["blocked (waiting for blocks)"] if any(e[0].rid == rid for e in getattr(self, "blocked", ())) else []
        return f"not in the scheduler; in {', '.join(places)}" if places else "unknown to this worker (finished, " \
            "aborted, or never received)"

    @contextlib.contextmanager
    def batched(self):
        """What this thread emits inside goes to each router as one ``batch`` message at the end."""
        self._local.outbox = outbox = {}
        try:
            yield
        finally:
            self._local.outbox = None
            for identity, msgs in outbox.items():
                if len(msgs) == 1:
                    msg = msgs[0]
                    self.server.send(identity, msg.pop("op"), **msg)
                else:
                    self.server.send(identity, "batch", msgs=msgs)

    def fail(self, rid: str, status: int, message: str, **fields) -> None:
        self.emit(rid, "error", status=status, message=message, **fields)

    def handle(self, msg: dict) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        return False

    def idle(self) -> bool:
        return self.inbox.empty() and not self.busy()

    def tick(self) -> None:
        pass

    def _on_signal(self, *_):
        if self.stopping.is_set():
            self.forced.set()
        self.stopping.set()

    def serve_forever(self) -> None:
        self.server.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("%s worker ready on %s", self.role, self.server.address)
        while not self._should_exit():
            try:
                msg = self.inbox.get(timeout=0 if self.busy() else 0.05)
                while True:
                    self._safe_handle(msg)
                    msg = self.inbox.get_nowait()
            except queue.Empty:
                pass
            self.tick()
            self._kv_events()
            self._forget_lost_routers()
        for rid in list(self.reply_to):
            self.fail(rid, 503, f"{self.role} worker shut down before the request finished", retry_after=1)
        time.sleep(0.1)
        self.close()

    def _should_exit(self) -> bool:
        if not self.stopping.is_set():
            return False
        now = time.monotonic()
        if self.draining_since is None:
            self.draining_since = now
            log.info("%s worker draining (at most %.0fs)", self.role, self.drain_s)
            for identity in list(self.peers):
                self.server.send(identity, "pong", info=self.describe(), t=None)
        waited = now - self.draining_since
        return self.forced.is_set() or waited > self.drain_s or (waited >= MIN_DRAIN_S and self.idle())

    def _forget_lost_routers(self) -> None:
        """Abort the requests of routers that went silent (at most every half second)."""
        now = time.monotonic()
        if now - self._peers_checked < 0.5:
            return
        self._peers_checked = now
        for identity, (seen, lost_after) in list(self.heard.items()):
            if now - seen <= lost_after:
                continue
            del self.heard[identity]
            self.peers.discard(identity)
            rids = [rid for rid, peer in list(self.reply_to.items()) if peer == identity]
            if rids:
                log.warning("router %s silent for %.0fs: aborting its %d requests", identity.hex(), now - seen, len(rids))
            for rid in rids:
                self.on_abort(rid)
                self.inbox.put({"op": "abort", "rid": rid})

    def _kv_events(self) -> None:
        """Prefix-cache keys stored, evicted, demoted (kept by a tier below the pool) and sunk (passed down to disk)
        since the last call, to every router (applied in that order: stored, demoted, sunk, evicted), and those put
        in the cluster-wide pool (``pooled``: the store's, not this worker's)."""
        if self.prefix_blocks is None or not self.peers:
            return
        stored, evicted = self.prefix_blocks.drain_events()
        (demoted, sunk), pooled = self.prefix_blocks.drain_demoted(), self.prefix_blocks.drain_pooled()
        if stored or evicted or demoted or sunk or pooled:
            for identity in list(self.peers):
                self.server.send(identity, "kv_events", stored=stored, evicted=evicted, demoted=demoted, sunk=sunk,
                                 pooled=pooled)

    def _safe_handle(self, msg):
        if msg["op"] == "_kv_snapshot":
            lower = self.prefix_blocks.lower_keys()
            self.server.send(msg["to"], "kv_events", reset=True, stored=self.prefix_blocks.keys() + lower,
                             evicted=[], demoted=lower, sunk=self.prefix_blocks.disk_keys(),
                             pooled=self.prefix_blocks.pooled_keys())
            return
        if msg["op"] == "abort":
            self.progressed.pop(msg["rid"], None)
        if msg["op"] == "abort" and msg.get("reason") == "stalled":
            log.warning("request %s given up by the router as stalled; here it was %s", msg["rid"],
                        self.where_is(msg["rid"]))
        try:
            self.handle(msg)
        except Exception as e:
            log.exception("failed to handle %s for %s", msg.get("op"), msg.get("rid"))
            self.fail(msg.get("rid"), 500, f"internal error: {e}")

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None and hasattr(engine, "close"):
            engine.close()
        self.server.close()


def fixed_world(transport: str, engine_cfg) -> None:
    """A clear error for the transport whose two processes form one fixed world (mlx) under ``--tp``: the slices of
    a tensor-parallel group go between many pairs of ranks."""
    if getattr(engine_cfg, "tp", 1) > 1 and transport == "mlx":
        raise ValueError(f"--transport {transport} pairs two processes in one fixed world and cannot carry the KV "
                         f"of --tp {engine_cfg.tp} groups; use tcp, shm, nccl, nixl, arrow, ray or pickle")


def dead_rank(group, wait_s: float = 0.5) -> tuple[int, int] | None:
    """``(rank, exit code)`` of a follower process that exited (``group.procs``: rank -> Popen) (waiting up to ``wait_s`` for one: a collective can fail a
    moment before its peer's exit is visible), or None."""
    end = time.monotonic() + wait_s
    while True:
        for rank, proc in getattr(group, "procs", {}).items():
            if proc.poll() is not None:
                return rank, proc.returncode
        if time.monotonic() >= end:
            return None
        time.sleep(0.05)
