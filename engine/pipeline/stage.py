"""A pipeline stage after the first (started by ``launch.Stages``): its layers, its pool, the plan loop.

It builds the engine for its span (``Engine(cfg, stage=StageRole(...))``: only these layers' weights, a pool of
these layers with the block count stage 0 sets), says hello, takes its setup, then for every ``step`` of the
plan: the block copies, the residual stream of that micro-batch from the stage before (``hops``), this
stage's layers, and the result on to the next stage (the last sends it back to stage 0). A ``tier`` message is a
copy of stage 0's host tier, made on this stage's layers (``kvcache.mirror``)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .hops import HopLink
from .launch import TOKEN_ENV, fingerprint, node_address

log = logging.getLogger("engine.pipeline.stage")


class StageRole:
    drives = False
    in_flight = False

    def __init__(self, stage: int, span: tuple[int, int], plan, token: bytes, transport: str):
        self.stage, self.span, self.plan = stage, span, plan
        self.token, self.transport = token, transport
        self.link = self.next = self.kv = None

    def agree_blocks(self, engine, blocks: int) -> int:
        """Say hello (what this stage runs, how many blocks it could hold, where its hops land), await setup."""
        self.link = HopLink(self.transport, self.token, engine.device, host=node_address())
        self.plan.report(kind="hello", stage=self.stage, span=list(self.span), model=fingerprint(engine),
                         blocks=blocks, address=self.link.address)
        while True:
            msg = self.plan.recv(1000)
            if msg is None:
                continue
            if msg["op"] == "setup":
                self.next = msg["next"]
                return msg["blocks"]
            if msg["op"] == "stop":
                sys.exit(0)

    def follow(self, engine, parent: int) -> None:
        from ..model_runner import StepRow

        while True:
            msg = self.plan.recv(1000)
            if msg is None:
                if os.getppid() != parent:
                    return
                continue
            if msg["op"] == "stop":
                return
            if msg["op"] == "kv_relay":  # this stage's layers of a KV that came whole to stage 0
                self.adopt(engine, msg)
                continue
            if msg["op"].startswith("kv_") and self.kv is not None:  # its part of a KV push or of a KV arriving
                self.kv.handle(msg)
                continue
            if msg["op"] == "tier":
                engine.tiers.mirror.handle(msg)
                continue
            if msg["op"] != "step":
                log.warning("stage %d: unknown plan op %r", self.stage, msg["op"])
                continue
            for source, target in msg["copies"]:
                engine.pool.copy_block(source, target)
            x, hops = self._recv(msg["tag"], parent)
            y, _ = engine.runner.stage_forward([StepRow(*r) for r in msg["rows"]], x)
            self.link.send(self.next, msg["tag"], y, hops)

    def _recv(self, tag: str, parent: int):
        """The micro-batch ``tag`` from the stage before, however long stage 0's part takes (a long chunk on a CPU),
        as long as stage 0 lives."""
        while True:
            try:
                return self.link.recv(tag, 5.0)
            except TimeoutError:
                if os.getppid() != parent:
                    raise

    def adopt(self, engine, msg: dict) -> None:
        """Write the layers stage 0 sent (tagged ``msg["tag"]``) into this stage's blocks ``msg["table"]``, before
        any later step of the plan reads them."""
        from kvtransfer.tensors import unpack

        received = self.link.receiver.wait(msg["tag"], self.link.timeout_s)
        try:
            engine.pool.scatter(msg["table"], unpack(received.buffer, received.layout) if received.layers is None
                                else received.layers)
        finally:
            received.release()

    def close(self) -> None:
        if self.link is not None:
            self.link.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.pipeline.stage")
    for name in ("stage", "parent"):
        ap.add_argument(f"--{name}", type=int, required=True)
    for name in ("span", "plan", "reports", "config"):
        ap.add_argument(f"--{name}", required=True)
    ap.add_argument("--kv", default=None, help="module:Class of this stage's part of its worker's KV pushes")
    ap.add_argument("--own-device", action="store_true", help="the first device this process sees (a Ray actor's "
                    "stage: its GPU), not the stage's of the worker's")
    args = ap.parse_args(argv)
    from ..parallel.follower import child_setup, kv_work

    child_setup(f"stage{args.stage}", args.parent)

    from ..config import EngineConfig
    from ..engine import Engine
    from ..loader import rank_device
    from ..parallel.plan import PlanReceiver

    cfg = EngineConfig(**json.loads(args.config))
    first, end = (int(n) for n in args.span.split(":"))
    plan = PlanReceiver(args.plan, args.reports)
    role = StageRole(args.stage, (first, end), plan, bytes.fromhex(os.environ[TOKEN_ENV]), cfg.pp_transport)
    engine = Engine(cfg, stage=role, device=rank_device(cfg.device, 0, 1) if args.own_device else
                    rank_device(cfg.device, args.stage, cfg.pp))
    role.kv = kv_work(args.kv, engine, plan)
    plan.report(kind="ready", stage=args.stage)  # pool built, graphs captured: hops may come
    try:
        role.follow(engine, args.parent)
    except Exception:
        log.exception("stage %d failed: exiting, so stage 0 restarts the pipeline", args.stage)
        return 1
    finally:
        role.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
