"""Start a pipeline's stages 1..pp-1 from stage 0 (the worker process), agree on the pool and wire the ring.

``start_stages`` splits the layers (``split.stage_spans``), binds the step
plan (``parallel.plan.PlanSender``: one zmq PUSH per stage, one PULL for
their reports) and starts each stage as ``python -m engine.pipeline.stage``
with its span; a watcher thread notices a stage that exits (the worker then
fails its requests and exits, so its supervisor restarts the pipeline as a
unit). Each stage loads its layers, opens its hop receiver and reports
``hello{stage, span, model, blocks, address}``; ``Stages.agree`` checks every
stage runs the same model with the span it was given (a disagreeing stage is
refused: start-up fails naming it), takes the smallest block count (every
stage's pool has the same blocks, so one block table serves all) and sends
each ``setup{blocks, next}``: the hop address of the stage after it (the
last stage's next is stage 0). A stage then builds its pool and captures its
CUDA graphs and reports ``ready``; stage 0 sends its first micro-batch only
after every stage is ready (``Stages.wait_ready``): a hop arriving while a
stage captures would allocate on the device in the middle of the capture."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time

from ..config import EngineConfig
from ..parallel.plan import PlanSender
from .split import stage_spans

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
TOKEN_ENV = "PDSERVE_PP_TOKEN"
PARENT = "{parent}"  # in a stage's command: the pid of the process that started it


def node_address() -> str:
    """Where this process's pipeline sockets listen: its node's address under Ray (stages on other nodes reach
    it), else loopback."""
    return os.environ.get("PDSERVE_RAY_NODE_IP", "127.0.0.1")


def model_layers(cfg: EngineConfig) -> int:
    """The configured model's layer count, read without loading it."""
    from ..loader import TINY_NAME, _config
    from ..tiny import TINY_CONFIG

    if cfg.model == TINY_NAME and cfg.load_format != "dummy":
        return TINY_CONFIG["num_hidden_layers"]
    return _config(cfg).num_hidden_layers


def fingerprint(engine) -> dict:
    """What every stage of one pipeline must agree on."""
    s = engine.model.spec
    return {"model": engine.name, "layers": s.num_layers, "hidden": s.hidden_size, "vocab": s.vocab_size,
            "dtype": str(engine.dtype), "block_size": engine.block_size}


class Stages:
    """Stage 0's handle on the others: their processes, the plan, the reports, the agreed wiring."""

    def __init__(self, cfg: EngineConfig, kv: tuple | None = None):
        """``kv``: ``(module:Class, environment)``: a stage's part of its worker's KV pushes (a prefill worker's)."""
        self.spans = stage_spans(model_layers(cfg), cfg.pp, cfg.pp_layers)
        self.token = secrets.token_bytes(16)
        self.plan = PlanSender(cfg.pp - 1, node_address())
        self.reports: queue.Queue = queue.Queue()
        self.plan.on_report = self.reports.put
        self.procs: dict[int, subprocess.Popen] = {}
        self.closing = False
        self.on_lost = _default_lost
        config = json.dumps(dataclasses.asdict(cfg))
        env = {**os.environ, **(kv[1] if kv else {}), TOKEN_ENV: self.token.hex()}
        cmds = {}
        for stage in range(1, cfg.pp):
            first, end = self.spans[stage]
            cmds[stage] = [sys.executable, "-m", "engine.pipeline.stage", "--stage", str(stage), "--span",
                           f"{first}:{end}", "--plan", self.plan.addresses[stage - 1], "--reports",
                           self.plan.report_address, "--config", config, "--parent", PARENT] + \
                (["--kv", kv[0]] if kv else [])
        if cfg.pp_placement_group:  # each stage on the node of its bundle, under a Ray actor
            from .ray_stages import start_stages

            self.procs = start_stages(cfg.pp_placement_group, cmds, {k: env[k] for k in env if k not in os.environ
                                                                     or k.startswith("PDSERVE")})
        else:
            for stage, cmd in cmds.items():
                cmd = [str(os.getpid()) if c == PARENT else c for c in cmd]
                self.procs[stage] = subprocess.Popen(cmd, env=env)
        self.hosts = [node_address()] + [getattr(p, "host", node_address()) for _, p in sorted(self.procs.items())]
        threading.Thread(target=self._watch, name="pp-watch", daemon=True).start()
        log.info("pipeline of %d stages, layers %s (stages 1..%d: pids %s)", cfg.pp, self.spans, cfg.pp - 1,
                 [p.pid for p in self.procs.values()])

    def agree(self, own: dict, blocks: int, address: str, timeout_s: float = START_TIMEOUT_S) -> int:
        """Wait for every stage's hello; refuse a stage that disagrees; send each its setup; the pool's blocks."""
        hellos = {}
        for msg in self._reports_of("hello", "did not start", timeout_s):
            self._check(msg, own)
            hellos[msg["stage"]] = msg
        blocks = min([blocks] + [m["blocks"] for m in hellos.values()])
        addresses = [address] + [hellos[s]["address"] for s in sorted(hellos)]
        for stage in self.procs:
            self.plan.send_to(stage, "setup", blocks=blocks, next=addresses[(stage + 1) % len(addresses)])
        self.next_address, self.addresses = addresses[1], addresses
        return blocks

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until every stage has reported ``ready`` (its engine built); other reports stay queued."""
        for _ in self._reports_of("ready", "not ready", timeout_s):
            pass

    def _reports_of(self, kind: str, failure: str, timeout_s: float):
        """Each stage's report of ``kind``, as they come; reports of other kinds stay queued. Fails when a stage
        exits first, or when one has not reported in ``timeout_s`` (``failure`` says how)."""
        seen, other, deadline = set(), [], time.monotonic() + timeout_s
        try:
            while len(seen) < len(self.procs):
                dead = [(s, p.returncode) for s, p in self.procs.items() if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"pipeline stage {dead[0][0]} exited during start-up (code {dead[0][1]})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pipeline stages {sorted(set(self.procs) - seen)} {failure} in "
                                       f"{timeout_s:.0f}s")
                try:
                    msg = self.reports.get(timeout=0.2)
                except queue.Empty:
                    continue
                if msg.get("kind") == kind:
                    seen.add(msg["stage"])
                    yield msg
                else:
                    other.append(msg)
        finally:
            for msg in other:
                self.reports.put(msg)

    def _check(self, msg: dict, own: dict) -> None:
        stage, span = msg["stage"], tuple(msg["span"])
        if span != self.spans[stage]:
            raise RuntimeError(f"pipeline stage {stage} holds layers {span}, the split gives it {self.spans[stage]}")
        theirs = msg["model"]
        diff = {k: (own[k], theirs.get(k)) for k in own if theirs.get(k) != own[k]}
        if diff:
            raise RuntimeError(f"pipeline stage {stage} runs another model than stage 0: "
                               + ", ".join(f"{k} {a!r} here, {b!r} there" for k, (a, b) in diff.items()))

    def _watch(self) -> None:
        while not self.closing:
            for stage, proc in self.procs.items():
                code = proc.poll()
                if code is not None and not self.closing:
                    self.on_lost(stage, code)
                    return
            time.sleep(0.1)

    def close(self, wait_s: float = 5.0) -> None:
        self.closing = True
        self.plan.close()
        deadline = time.monotonic() + wait_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


def _default_lost(stage: int, code: int) -> None:
    log.error("pipeline stage %d exited (code %s): this worker exits too, so the pipeline restarts as a unit",
              stage, code)
    os._exit(70)
