"""Every request ends, and every token message says which token it is.

A prompt whose blocks are all in the prefix cache computes only its last token: a one-token row, which runs through
the fixed-shape decode path and so steps ahead (``engine.overlap``). When the next step cannot follow (a new prompt
arrives), the step in flight is read first and this step's token comes after it: one step output then holds two
tokens of the same sequence. Each must go out as what it is (the first as ``first``, the last as ``done``), or the
router, waiting for ``first``, never answers. The worker here runs in this process, its engine stepped by hand
(``decode_graphs="eager"``: on the CPU the same fixed-shape step the CUDA graphs capture), so the order is fixed."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from decode.worker import DecodeWorker
from deploy.local import Cluster
from engine import EngineConfig
from tests.test_failures import eventually

BLOCK = 16
PROMPT = [(7 * i + 3) % 200 + 20 for i in range(4 * BLOCK)]  # four whole blocks: all cached after one run
FRESH = [(11 * i + 5) % 200 + 20 for i in range(3 * BLOCK + 5)]


class Recorder:
    """The worker's messages per request, in the order emitted."""

    def __init__(self, worker: DecodeWorker):
        self.msgs: dict[str, list[dict]] = {}
        worker.emit = self.emit

    def emit(self, rid, op, **fields):
        self.msgs.setdefault(rid, []).append({"op": op, **fields})


def worker(**kw) -> tuple[DecodeWorker, Recorder]:
    cfg = EngineConfig(threads=1, dtype="float32", decode_graphs="eager", block_size=BLOCK, warmup=False, **kw)
    w = DecodeWorker(cfg, colocated=True)
    return w, Recorder(w)


def generate(w: DecodeWorker, rid: str, prompt: list[int], max_tokens: int) -> None:
    w.handle({"op": "generate", "rid": rid, "prompt": prompt,
              "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})


def run_until_idle(w: DecodeWorker, limit: int = 200) -> None:
    for _ in range(limit):
        if not w.engine.has_work:
            return
        w.tick()
    raise AssertionError("the engine did not finish")


def check_contract(msgs: list[dict], max_tokens: int) -> list[int]:
    """``first``, then ``tokens``, then one ``done``, indices in order with no gap; the token ids."""
    assert msgs[0]["op"] == "first", [m["op"] for m in msgs]
    ids = [msgs[0]["token"]]
    if msgs[0].get("finish_reason"):
        assert len(msgs) == 1
        return ids
    for m in msgs[1:-1]:
        assert m["op"] == "tokens" and m["index"] == len(ids), m
        ids += m["ids"]
    assert msgs[-1]["op"] == "done" and msgs[-1]["index"] == len(ids), msgs[-1]
    ids += msgs[-1]["ids"]
    assert msgs[-1]["completion_tokens"] == len(ids) == max_tokens
    return ids


@pytest.mark.parametrize("max_tokens", [1, 2, 6])
def test_a_cached_prompt_stepped_ahead_then_a_new_prompt_keeps_its_messages_in_order(max_tokens):
    w, rec = worker()
    try:
        generate(w, "warm", PROMPT, 6)
        run_until_idle(w)
        want = check_contract(rec.msgs["warm"], 6)[:max_tokens]
        generate(w, "cached", PROMPT, max_tokens)
        w.tick()  # the cached prompt's last token alone: a one-token row, left on the device
        assert w.engine.inflight is not None or max_tokens == 1
        generate(w, "fresh", FRESH, 4)  # the next step cannot follow: it reads the step in flight, then steps
        run_until_idle(w)
        assert check_contract(rec.msgs["cached"], max_tokens) == want
        check_contract(rec.msgs["fresh"], 4)
        assert w.completed == 3  # a request that ends at its first token counts too
        assert w.engine.blocks.num_free == w.engine.num_blocks and not any(w.engine.blocks.refs)  # none leaked
        assert not w.live and not w.reserved
    finally:
        w.close()


def test_a_burst_of_identical_cached_prompts_with_fresh_ones_all_end():
    w, rec = worker(max_num_seqs=8)
    try:
        generate(w, "warm", PROMPT, 5)
        run_until_idle(w)
        want = check_contract(rec.msgs["warm"], 5)
        for i in range(12):  # arriving a few at a time, between steps
            generate(w, f"c{i}", PROMPT, 5)
            if i % 3 == 2:
                generate(w, f"f{i}", FRESH[i:], 3)
            w.tick()
        run_until_idle(w)
        for i in range(12):
            assert check_contract(rec.msgs[f"c{i}"], 5) == want
            if i % 3 == 2:
                check_contract(rec.msgs[f"f{i}"], 3)
        assert not w.live and w.completed == 1 + 12 + 4
        assert w.engine.blocks.num_free == w.engine.num_blocks and not any(w.engine.blocks.refs)
    finally:
        w.close()


def test_up_answers_a_burst_of_cached_and_fresh_prompts_through_the_stepped_ahead_path():
    """As the GPU sequence that hung: prompts once one at a time, then a burst of 32 clients over those (their blocks
    all cached) and fresh ones; every request answered, counted, and no block left taken."""
    cluster = Cluster("--colocated", "--decode-graphs", "eager", "--stall-timeout", "20").wait_ready()
    try:
        client = OpenAI(base_url=cluster.url + "/v1", api_key="unused")
        prompts = [[(13 * i + 7 * j) % 200 + 20 for j in range(4 * BLOCK)] for i in range(8)]
        for p in prompts:
            client.completions.create(model="tiny-llama", prompt=p, max_tokens=8, temperature=0)

        def one(i):
            prompt = prompts[i % 8] if i % 4 else [(5 * i + j) % 200 + 20 for j in range(3 * BLOCK + i % 7)]
            r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=1 + i % 9, temperature=0,
                                          extra_body={"ignore_eos": True}, timeout=60)
            return r.choices[0].finish_reason, r.usage.completion_tokens, 1 + i % 9

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(96)))
        assert all(reason == "length" and got == want for reason, got, want in results), results

        def settled():  # a worker's figures reach /health with its next heartbeat
            health = httpx.get(cluster.url + "/health", timeout=5).json()
            (worker,) = health["workers"]["colocated"]
            return worker["completed"] == 8 + 96 and worker["kv_blocks_free"] == worker["kv_blocks"] \
                and health["admission"]["in_flight"] == 0 and worker["prefix_hits"] >= 8 and worker
        assert eventually(settled, 10), httpx.get(cluster.url + "/health", timeout=5).json()["workers"]
    finally:
        cluster.stop()
