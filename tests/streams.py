"""Streaming clients in background threads that record what they saw and when."""
from __future__ import annotations

import json
import threading
import time

import httpx


class StreamClient(threading.Thread):
    def __init__(self, url: str, body: dict, timeout: float = 120.0):
        super().__init__(daemon=True)
        self.url, self.body, self.timeout = url, {**body, "stream": True, "return_token_ids": True}, timeout
        self.tokens = 0
        self.error: dict | None = None
        self.status: int | None = None
        self.finished = False
        self.ended_at: float | None = None
        self.first_at: float | None = None
        self.ids: list[int] = []
        self.text = ""
        self.pdserve: dict | None = None  # the final chunk's timing block
        self.client = httpx.Client(timeout=timeout)  # built here: building it in the thread can stall behind other streams

    def run(self):
        try:
            with self.client.stream("POST", self.url + "/v1/completions", json=self.body) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.error = json.loads(r.read()).get("error")
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]
                    elif chunk["choices"]:
                        self.ids += chunk["choices"][0].get("token_ids") or []
                        self.text += chunk["choices"][0].get("text") or ""
                        self.tokens = len(self.ids)
                        self.pdserve = chunk.get("pdserve") or self.pdserve
                        self.first_at = self.first_at or time.monotonic()
                        self.finished = self.finished or bool(chunk["choices"][0].get("finish_reason"))
        except httpx.HTTPError as e:
            self.error = {"message": f"client: {e!r}"}
        finally:
            self.ended_at = time.monotonic()
            self.client.close()

    def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while self.tokens < n and self.ended_at is None and time.monotonic() < end:
            time.sleep(0.02)
        assert self.tokens >= n, f"stream saw {self.tokens} tokens (error={self.error})"


def started(clients: list[StreamClient]) -> list[StreamClient]:
    for c in clients:
        c.start()
    return clients


def streams_the_engines_tokens(path: str, prompts: list[str], flags: list[str], max_tokens: int = 8,
                               **engine_kw) -> list:
    """``pdserve up`` with ``flags`` on the checkpoint at ``path``: the prompts streamed at once (``max_tokens``
    greedy tokens each) equal one torch engine's (``engine_kw``: its config); returns the clients, the first with the cluster's
    ``health`` from the moment they ended."""
    from deploy.local import Cluster
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many

    engine = Engine(EngineConfig(model=path, threads=1, **engine_kw))
    want = [s.output_ids for _, s in generate_many(
        engine, [engine.tokenizer.encode(p) for p in prompts],
        [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True) for _ in prompts])]
    cluster = Cluster(*flags, "--model", path)
    try:
        cluster.wait_ready()
        bodies = [{"model": path.rsplit("/", 1)[1], "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                   "ignore_eos": True} for p in prompts]
        clients = started([StreamClient(cluster.url, b) for b in bodies])
        for c in clients:
            c.join(120)
        assert [c.error for c in clients] == [None] * len(prompts)
        assert [c.ids for c in clients] == want
        clients[0].health = httpx.get(cluster.url + "/health", timeout=10).json()
        return clients
    finally:
        cluster.stop()
