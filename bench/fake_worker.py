"""A colocated worker with no model, for ``pdserve bench router``: it speaks the real control protocol
(``control.worker.WorkerLoop``: pong with its description, ``generate``/``abort``, replies batched per step) and
answers every ``generate`` with ``max_tokens`` tokens of one fixed text, one token per live request per "step",
steps back to back (``--step-ms 0``: as fast as this process can) — so the router, not an engine, sets the pace.

    python -m bench.fake_worker --port 7001 [--step-ms 0]    (or --control-fd N: a listening socket handed over)"""
from __future__ import annotations

import argparse
import logging
import time

from control.listen import inherited
from control.worker import WorkerLoop

TOKEN_ID, TOKEN_TEXT = 42, " tok"


class FakeWorker(WorkerLoop):
    role = "colocated"

    def __init__(self, host: str, port: int, step_ms: float = 0.0):
        super().__init__(host, port)
        self.step_s = step_ms / 1e3
        self.live: dict[str, list] = {}  # rid -> [tokens left, prompt tokens, tokens sent]
        self.tokens_sent = 0
        self._next_step = 0.0

    def info(self) -> dict:
        return {"role": self.role, "model": "fake", "engine": "fake", "tp": 1, "max_len": 1 << 20,
                "kv_budget_bytes": 1 << 40, "kv_bytes_per_token": 1, "kv_block_size": 16, "kv_blocks": 1 << 30,
                "kv_blocks_free": 1 << 30, "active": len(self.live), "tokenizer": "builtin",
                "tokens_sent": self.tokens_sent}

    def busy(self) -> bool:
        return bool(self.live)

    def handle(self, msg: dict) -> None:
        rid = msg["rid"]
        if msg["op"] == "abort":
            self.live.pop(rid, None)
        elif msg["op"] == "generate":
            params = msg.get("params") or {}
            prompt = msg.get("prompt") or ""
            self.live[rid] = [max(1, int(params.get("max_tokens") or 16)), max(1, len(prompt)), 0]
        else:
            self.fail(rid, 400, f"the fake worker does not do {msg['op']}")

    def tick(self) -> None:
        if not self.live:
            return
        wait = self._next_step - time.perf_counter()
        if wait > 0:  # an engine's step sleeps on the device: let the control thread (pongs) run meanwhile
            time.sleep(min(wait, 0.002))
            return
        self._next_step = time.perf_counter() + self.step_s
        with self.batched():
            for rid, state in list(self.live.items()):
                self._one(rid, state)

    def _one(self, rid: str, state: list) -> None:
        left, prompt_tokens, sent = state
        state[0], state[2] = left - 1, sent + 1
        self.tokens_sent += 1
        finish = "length" if left == 1 else None
        if sent == 0:
            self.emit(rid, "first", token=TOKEN_ID, text=TOKEN_TEXT, emitted=len(TOKEN_TEXT),
                      prompt_tokens=prompt_tokens, prompt_ids=[TOKEN_ID], params={"max_tokens": sent + left},
                      finish_reason=finish, logprobs=None, timing={"queue": 0.0, "prefill": 0.0})
        elif finish is None:
            self.emit(rid, "tokens", ids=[TOKEN_ID], text=TOKEN_TEXT, logprobs=None)
        else:
            self.emit(rid, "done", ids=[TOKEN_ID], text=TOKEN_TEXT, finish_reason=finish, completion_tokens=sent + 1,
                      timing={"decode": 0.0}, phases=None, logprobs=None)
        if finish is not None:
            del self.live[rid]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fake_worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--control-fd", type=int, default=None, help="a listening socket inherited as this descriptor")
    p.add_argument("--step-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    port = args.port if args.control_fd is None else inherited(args.control_fd)
    FakeWorker(args.host, port, args.step_ms).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
