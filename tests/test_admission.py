"""Admission control with real processes: the decode KV budget, the router's bounded
queue (429 when full, 503 after waiting too long, both with Retry-After), the decode
worker's own budget check, and the prefill queue bound."""
import threading
import time

import httpx
import pytest

from tests.checkpoints import SLOW, write_checkpoint
from tests.fleet import Fleet
from tests.streams import StreamClient
from tests.test_failures import LONG, complete, decode_is_clean, eventually

# tiny-llama keeps 1 KiB of KV per token: one LONG request (~916 tokens) fits in 1.2M, two do not
BUDGET = "1.2M"


def test_budget_queue_429_then_503_with_retry_after(tmp_path):
    """On the slow model (6 KiB of KV a token: one LONG request fits in 8M, two do not; its 900 tokens take seconds),
    so the running stream holds its memory past the queued one's 2 s and the third request meets the queue full,
    however loaded the machine."""
    slow = write_checkpoint(tmp_path / "slow", SLOW)
    long, short = {**LONG, "model": "slow"}, {"model": "slow", "prompt": "Hi", "max_tokens": 8}
    with Fleet("--model", slow) as f:
        f.worker("p", "prefill")
        f.worker("d", "decode", "--kv-budget", "8M")
        f.router("--max-queue", "1", "--queue-timeout", "2")
        f.wait_healthy()
        info = f.worker_info("d")
        block = info["kv_block_size"] * info["kv_bytes_per_token"]
        assert (8 << 20) - block < info["kv_budget_bytes"] <= 8 << 20
        running = StreamClient(f.url, long)
        running.start()
        running.wait_tokens(3)
        waiting = StreamClient(f.url, long)
        waiting.start()
        assert eventually(lambda: f.health()["admission"]["queued"] == 1, 2)
        refused = complete(f.url, short)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        waiting.join(20)
        assert waiting.status == 503 and "no KV memory free" in waiting.error["message"]
        assert running.ended_at is None or running.ended_at > waiting.ended_at
        running.join(180)
        assert running.finished and running.tokens == LONG["max_tokens"]
        assert complete(f.url, short).status_code == 200
        assert eventually(lambda: decode_is_clean(f, "d"))
        metrics = httpx.get(f.url + "/metrics").text
        assert 'pdserve_admission_rejected_total{status="429"} 1.0' in metrics


@pytest.mark.serial
def test_queued_request_is_served_when_memory_frees():
    with Fleet() as f:
        f.worker("p", "prefill")
        f.worker("d", "decode", "--kv-budget", BUDGET)
        f.router("--queue-timeout", "60")
        f.wait_healthy()
        first, second = StreamClient(f.url, LONG), StreamClient(f.url, LONG)
        first.start()
        first.wait_tokens(3)
        second_sent = time.monotonic()
        second.start()
        first.join(60)
        second.join(60)
        assert first.finished and second.finished and not second.error
        assert second.first_at > first.ended_at - 0.5
        waited_ms = (first.ended_at - second_sent) * 1e3  # the second waited for the first's KV room
        assert first.pdserve["admit"] < 200 and second.pdserve["admit"] > waited_ms - 500


def test_decode_refuses_beyond_its_budget_even_behind_two_routers():
    with Fleet() as f:
        f.worker("p", "prefill")
        f.worker("d", "decode", "--kv-budget", BUDGET)
        url_a = f.router(name="router-a")
        url_b = f.router(name="router-b")
        for url in (url_a, url_b):
            f.url = url
            f.wait_healthy()
        running = StreamClient(url_a, LONG)
        running.start()
        running.wait_tokens(3)
        r = complete(url_b, LONG)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "decode KV budget full" in r.json()["error"]["message"]
        running.join(60)
        assert running.finished
        assert eventually(lambda: decode_is_clean(f, "d"))


def test_prefill_queue_is_bounded(tmp_path):
    model_dir = write_checkpoint(tmp_path / "slow", SLOW)
    body = {"model": "slow", "prompt": "x" * 2500, "max_tokens": 2}
    with Fleet("--model", model_dir) as f:
        f.pair(prefill=("--max-queue", "1", "--max-num-seqs", "1"))
        results = []
        threads = [threading.Thread(target=lambda: results.append(complete(f.url, body))) for _ in range(3)]
        for t, pause in zip(threads, (0.3, 0.1, 0)):
            t.start()
            time.sleep(pause)
        for t in threads:
            t.join(60)
        codes = sorted(r.status_code for r in results)
        assert codes == [200, 200, 503], [r.text for r in results]
        refused = next(r for r in results if r.status_code == 503)
        assert "prefill queue full" in refused.json()["error"]["message"] and refused.headers["retry-after"] == "1"
