"""Roles at runtime (``router.roles``) through ``pdserve up --mixed`` and ``pdserve role``: a mixed worker leaves the
decode picks and its streams move away as undisturbed, leaves the prefill picks, comes back to both; bad asks are
refused with 4xx."""
from __future__ import annotations

import asyncio

import httpx

from deploy.local import Cluster
from pdserve.cli import main as pdserve
from tests.moves import TOKENS, decode_workers, health, model, run_streams, undrain, until_moved  # noqa: F401
from tests.test_failures import eventually


def role(url: str, worker: str, new: str, force: bool = False) -> httpx.Response:
    return httpx.post(url + "/admin/role", json={"worker": worker, "role": new, "force": force}, timeout=30)


def back_to_mixed(url: str, worker: str) -> None:
    """A run whose streams all ended before the role change moved none: the worker back in both picks."""
    assert role(url, worker, "mixed").status_code == 200
    assert eventually(lambda: all(w["drain"] == "serving" for w in health(url)["workers"]["decode"] + health(url)[
        "workers"]["prefill"] if w["address"] == worker), 10)


def test_a_mixed_worker_changes_role_at_runtime_and_its_streams_move_away(model):
    """``POST /admin/role`` on a mixed worker: ``prefill`` takes it out of the decode picks and moves what decodes
    there to the decode worker (texts as undisturbed), ``decode`` out of the prefill picks, ``mixed`` back in both;
    a worker started as decode, an unknown worker or role, and leaving the last prefill worker are refused."""
    c = Cluster("--prefill", "1", "--decode", "1", "--mixed", "1", "--model", model, "--policy", "round_robin").wait_ready()
    try:
        url, name = c.url, model.rsplit("/", 1)[1]
        workers = health(url)["workers"]
        mixed = next(w["address"] for w in workers["decode"] if w.get("role") == "mixed")
        plain_decode = next(w["address"] for w in workers["decode"] if w.get("role") != "mixed")
        plain_prefill = next(w["address"] for w in workers["prefill"] if w["address"] != mixed)
        assert role(url, plain_decode, "prefill").status_code == 409
        assert role(url, "tcp://127.0.0.1:1", "decode").status_code == 404
        assert role(url, mixed, "router").status_code == 400
        bodies = [{"model": name, "max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True},
                   "prompt": f"stream {i} of four: the quick brown fox"} for i in range(4)]
        want, _ = run_streams(url, bodies)
        only_mixed_decodes = lambda: pdserve(["drain", "--url", url, "--worker", plain_decode]) == 0  # noqa: E731

        def to_prefill(u):  # every stream decodes on the mixed worker (the decode pick may keep off it otherwise)
            undrain(u, plain_decode)
            return role(u, mixed, "prefill").json()
        assert only_mixed_decodes()
        (got, _), runs = until_moved(url, lambda: run_streams(url, bodies, to_prefill),
                                     lambda _: (back_to_mixed(url, mixed), only_mixed_decodes()))
        assert [s.texts for s in got] == [s.texts for s in want]
        assert all(set(s.tokens.values()) == {TOKENS} for s in got), [s.tokens for s in got]
        mixed_decode = lambda: next(w for w in decode_workers(url) if w["address"] == mixed)  # noqa: E731
        assert eventually(lambda: mixed_decode()["drain"] == "drained" and mixed_decode()["active"] == 0, 30)
        assert pdserve(["role", "--url", url, "--worker", mixed, "--role", "decode"]) == 0
        assert next(w for w in health(url)["workers"]["prefill"] if w["address"] == mixed)["drain"] != "serving"
        assert httpx.post(url + "/admin/drain", json={"worker": plain_prefill}, timeout=10).status_code == 409
        again, _ = run_streams(url, bodies[:2])  # prompts on the plain prefill worker, decode on either
        assert [s.texts for s in again] == [s.texts for s in want[:2]]
        assert role(url, mixed, "mixed").json() == {"worker": mixed, "role": "mixed", "prefill_drain": "serving",
                                                    "decode_drain": "serving"}
        assert f'pdserve_role_changes_total{{role="prefill"}} {runs}.0' in httpx.get(url + "/metrics", timeout=10).text
    finally:
        c.stop()


def test_mixed_workers_prefill_for_each_other_and_move_streams_over_nccl(model):
    """Mixed workers over nccl (gloo pairs on the CPU): each prefills prompts that decode on the other and receives
    theirs (pairs of its own each way), and a role change moves its streams over nccl, texts as undisturbed."""
    c = Cluster("--prefill", "0", "--decode", "0", "--mixed", "2", "--transport", "nccl", "--device", "cpu",
                "--kv-option", "nccl_backend=gloo", "--model", model, "--policy", "round_robin").wait_ready()
    try:
        url, name = c.url, model.rsplit("/", 1)[1]
        first, _ = (w["address"] for w in decode_workers(url))
        bodies = [{"model": name, "max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True},
                   "prompt": f"stream {i} of four: the quick brown fox"} for i in range(4)]
        want, _ = run_streams(url, bodies)
        both = lambda: all(w["prefilled_for_others"] > 0 for w in decode_workers(url))  # noqa: E731 (reports lag)
        assert eventually(both, 30), decode_workers(url)
        (got, _), _ = until_moved(url, lambda: run_streams(url, bodies, lambda u: role(u, first, "prefill").json()),
                                  lambda _: back_to_mixed(url, first))
        assert [s.texts for s in got] == [s.texts for s in want]
        assert all(set(s.tokens.values()) == {TOKENS} for s in got), [s.tokens for s in got]
    finally:
        c.stop()


def test_roles_auto_moves_a_mixed_worker_to_prompts_under_a_burst_of_long_prompts():
    """``pdserve up --mixed 3 --roles auto`` (``--disagg always``): a burst of long prompts with short answers keeps
    the prefill workers' waits over ``--disagg-prefill-wait-ms`` (each prompt's tokens counted by the router) until
    the controller makes a worker ``prefill``; every request is answered. The controller first settles the three
    mixed workers, a pass each: decode, prefill, decode."""
    c = Cluster("--prefill", "0", "--decode", "0", "--mixed", "3", "--roles", "auto",
                "--disagg-prefill-wait-ms", "200").wait_ready()
    try:
        assert eventually(lambda: serving(c.url) == {"prefill": 1, "decode": 2}, 30), health(c.url)["workers"]
        settled = changes(c.url)
        assert settled == 1
        codes = asyncio.run(long_prompts(c.url, 600, 0.005, lambda: changes(c.url) > settled, every=100))
        assert codes == [200] * len(codes)
        assert eventually(lambda: changes(c.url) > settled, 10), httpx.get(c.url + "/metrics", timeout=10).text
        assert serving(c.url) == {"prefill": 2, "decode": 1}, health(c.url)["workers"]  # a decode worker moved
    finally:
        c.stop()


async def long_prompts(url: str, count: int, gap_s: float, done, every: int = 8) -> list[int]:
    """Up to ``count`` ~920-token prompts with 4-token answers, one every ``gap_s``, until ``done()`` (asked every
    ``every`` of them); the status codes once every one has been answered."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i):
            body = {"model": "tiny-llama", "prompt": f"long prompt {i:03d} " + "the quick brown fox " * 45,
                    "max_tokens": 4, "temperature": 0}
            return (await client.post(url + "/v1/completions", json=body)).status_code
        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(gap_s)
            if i % every == every - 1 and await asyncio.to_thread(done):
                break
        return [await t for t in tasks]


def serving(url: str) -> dict:
    """How many workers serve each side (are in its picks, not drained from it)."""
    groups = health(url)["workers"]
    return {role: sum(w["drain"] == "serving" for w in groups[role]) for role in ("prefill", "decode")}


def changes(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('pdserve_role_changes_total{role="prefill"}'))
