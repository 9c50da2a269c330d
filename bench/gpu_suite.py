"""Users' traffic through each serving mode, checked for what every request owes its client: it ends (tokens or an
error, never a wait), nothing stalls, no KV block stays taken, and greedy text equals the colocated one.

For each mode a ``pdserve up`` cluster serves, in order: fresh prompts; the same prompts again (their blocks all in
the prefix cache) as a burst; 32 identical prompts at once; multi-turn chats over a shared system prompt; streams
cancelled mid-way; ``n`` > 1, logprobs and a JSON schema. A case passes with 0 errors, 0 requests past their
deadline, 0 stalls (``pdserve_requests_stalled_total``) and every worker's blocks free afterwards. ``--long N``
serves the long-context case instead: a prompt of N tokens, the same again from the prefix cache, and a prompt one
token over the context, which must be refused with a 400 at once. The report (JSON,
one row per case, and a line each on the terminal) goes to ``--out``.

    python -m bench.gpu_suite --modes colocated,1p1d-nccl,1p1d-tcp --out bench/results/gpu-suite-h100.json \\
        --model mistral-7b --load-format dummy --dtype bfloat16

(``bash bench/gpu/suite.sh`` picks the modes the machine's GPU count allows.) On the CPU with the tiny model it
runs the same cases (``--modes colocated,1p1d-tcp``; a smoke run)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from deploy.local import Cluster

log = logging.getLogger(__name__)

MODES = {
    "colocated": ["--colocated"],
    "colocated-eager": ["--colocated", "--no-overlap"],
    "1p1d-nccl": ["--transport", "nccl"],
    "1p1d-tcp": ["--transport", "tcp"],
    "tp2-colocated": ["--colocated", "--tp", "2"],
    "fp8-colocated": ["--colocated", "--kv-cache-dtype", "fp8", "--quantization", "fp8"],
    "tp2-1p1d-nccl": ["--transport", "nccl", "--prefill-tp", "2", "--decode-tp", "2"],
    "ray-1p1d-nccl": ["--transport", "nccl"],  # pdserve deploy ray: a prefill and a decode actor of one GPU each
}
GPUS = {"colocated": 1, "colocated-eager": 1, "1p1d-nccl": 2, "1p1d-tcp": 2, "tp2-colocated": 2, "fp8-colocated": 1,
        "tp2-1p1d-nccl": 4, "ray-1p1d-nccl": 2}
PROMPT_LEN = 512


def prompts(count: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """Token-id prompts (bytes of the byte tokenizer, so any checkpoint of it takes them)."""
    return [[(seed * 7919 + i * 104729 + j * 31) % 90 + 35 for j in range(length)] for i in range(count)]


class Traffic:
    def __init__(self, url: str, model: str, timeout: float):
        self.url, self.model, self.timeout = url, model, timeout
        self.client = httpx.Client(timeout=timeout)

    def complete(self, prompt, max_tokens=64, **extra) -> dict:
        return self._post("/v1/completions", prompt=prompt, max_tokens=max_tokens, **extra)

    def chat(self, messages, max_tokens=32, **extra) -> dict:
        return self._post("/v1/chat/completions", messages=messages, max_tokens=max_tokens, **extra)

    def _post(self, path: str, **fields) -> dict:
        """The response's JSON; ``{"stuck": True}`` past the timeout, ``{"error": ...}`` for any other status."""
        try:
            r = self.client.post(self.url + path, json={"model": self.model, "temperature": 0, **fields})
        except httpx.TimeoutException:
            return {"stuck": True}
        return r.json() if r.status_code == 200 else {"error": f"{r.status_code} {r.text[:200]}"}

    def cancelled_stream(self, prompt, after: int = 3) -> dict:
        """A stream the client closes after ``after`` chunks."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 256, "stream": True, "ignore_eos": True}
        seen = 0
        try:
            with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    seen += line.startswith("data: {")
                    if seen >= after:
                        break
        except httpx.TimeoutException:
            return {"stuck": True}
        return {"choices": [{"text": "", "finish_reason": "cancelled"}], "usage": {"completion_tokens": seen}}

    def at_once(self, calls: list, concurrency: int) -> list[dict]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda c: c[0](*c[1], **c[2]), calls))


def cases(t: Traffic) -> dict:
    fresh = prompts(16, 1)
    system = {"role": "system", "content": "You are a terse assistant. " * 30}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}

    def chats():
        out = []
        for turn in range(2):
            calls = []
            for i in range(8):
                history = [system, {"role": "user", "content": f"conversation {i}, question {turn}"}]
                calls.append((t.chat, (history,), {}))
            out += t.at_once(calls, 8)
        return out

    return {
        "fresh": lambda: t.at_once([(t.complete, (p,), {}) for p in fresh], 8),
        "repeated (full prefix hits, burst)": lambda: t.at_once([(t.complete, (p,), {}) for p in fresh * 2], 32),
        "32 identical at once": lambda: t.at_once([(t.complete, (fresh[0],), {})] * 32, 32),
        "multi-turn chat, shared system prompt": chats,
        "cancelled mid-stream": lambda: t.at_once([(t.cancelled_stream, (p,), {}) for p in prompts(8, 2)], 8),
        "n=2, logprobs, json schema": lambda: t.at_once(
            [(t.complete, (fresh[1],), {"n": 2, "temperature": 0.8, "seed": 3})] * 4
            + [(t.complete, (fresh[2],), {"logprobs": 2})] * 4
            + [(t.chat, ([{"role": "user", "content": "a json please"}],),
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                            "strict": True}}})] * 4, 12),
    }


def long_cases(t: Traffic, tokens: int, max_len: int) -> dict:
    """``--long``: one prompt of ``tokens`` tokens, the same again (its blocks in the prefix cache), and one token
    over the workers' context, which must get a 400 at once."""
    prompt = prompts(1, 5, tokens)[0]

    def over_the_context():
        start = time.perf_counter()
        r = t.complete(prompts(1, 6, max_len + 1)[0], max_tokens=4)
        if str(r.get("error", "")).startswith("400") and time.perf_counter() - start < 5:
            return [{"choices": [{"text": ""}], "usage": {}}]
        return [{"error": f"wanted a 400 within 5 s, got {str(r)[:200]}"}]

    return {f"long prompt ({tokens} tokens)": lambda: [t.complete(prompt, max_tokens=16)],
            "the same long prompt again (prefix cached)": lambda: [t.complete(prompt, max_tokens=16)],
            f"a prompt over the context ({max_len + 1} tokens): 400 at once": over_the_context}


def max_len(url: str) -> int:
    workers = httpx.get(url + "/health", timeout=5).json()["workers"]
    return min(w["max_len"] for ws in workers.values() for w in ws if w.get("max_len"))


def leaked(url: str, wait_s: float = 15.0) -> list[str]:
    """Workers whose blocks are not all free once the cluster is idle (waiting up to ``wait_s`` for heartbeats)."""
    end = time.monotonic() + wait_s
    while True:
        health = httpx.get(url + "/health", timeout=5).json()
        bad = [f"{role}:{w['address']} {w['kv_blocks'] - w['kv_blocks_free']} blocks"
               for role, ws in health["workers"].items() for w in ws if w.get("kv_blocks_free") != w.get("kv_blocks")]
        if not bad and health["admission"]["in_flight"] == 0 or time.monotonic() > end:
            return bad
        time.sleep(0.5)


def stalls(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"pdserve_requests_stalled_total\{[^}]*\} (\S+)", text))


class RayDeployment:
    """``pdserve deploy ray`` (a local Ray cluster it starts) with one prefill and one decode actor of
    ``gpus_per_worker`` GPUs each; ``url`` and ``stop`` as ``deploy.local.Cluster`` has them."""

    def __init__(self, *args: str, gpus_per_worker: float = 1, ready_timeout: float = 600):
        self.name = f"suite-{os.getpid()}"
        self._deploy("ray", "--name", self.name, "--prefill", "1", "--decode", "1", "--gpus-per-worker",
                     str(gpus_per_worker), "--port", "0", *args)
        self.url = json.loads(self._deploy("status", "--name", self.name, "--json"))["url"]
        end = time.monotonic() + ready_timeout
        while not self.ready():
            if time.monotonic() > end:
                self.stop()
                raise TimeoutError("the Ray deployment's workers did not become healthy")
            time.sleep(1)

    @staticmethod
    def _deploy(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "pdserve", "deploy", *args], capture_output=True, text=True,
                             timeout=600)
        if out.returncode:
            raise RuntimeError(f"pdserve deploy {args[0]} failed: {out.stderr[-1500:]}")
        return out.stdout

    def ready(self) -> bool:
        try:
            workers = httpx.get(self.url + "/health", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return all(len([w for w in workers.get(r, []) if w.get("healthy")]) == 1 for r in ("prefill", "decode"))

    def gpus_in_use(self) -> list[str]:
        """The GPUs (bus ids) that hold a process: one each for the prefill and the decode actor's process."""
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True)
        return sorted(set(out.stdout.split()))

    def stop(self) -> None:
        self._deploy("down", "--name", self.name)


def start(mode: str, args):
    if mode.startswith("ray-"):
        log.info("mode %s: pdserve deploy ray %s", mode, " ".join(MODES[mode] + args.up))
        return RayDeployment(*MODES[mode], *args.up, gpus_per_worker=1 if args.gpus else 0)
    extra = MODES[mode] + args.up + (["--gpus", str(min(GPUS[mode], args.gpus_here))] if args.gpus else [])
    log.info("mode %s: pdserve up %s", mode, " ".join(extra))
    return Cluster(*extra, ready_timeout=600).wait_ready()


def run_mode(mode: str, args) -> list[dict]:
    cluster = start(mode, args)
    rows = []
    try:
        placed = cluster.gpus_in_use() if isinstance(cluster, RayDeployment) and args.gpus else None
        t = Traffic(cluster.url, args.served, args.timeout)
        chosen = long_cases(t, args.long, max_len(cluster.url)) if args.long else cases(t)
        for name, case in chosen.items():
            t0 = time.perf_counter()
            results = case()
            wall = time.perf_counter() - t0
            errors = [r["error"] for r in results if "error" in r]
            stuck = sum(1 for r in results if r.get("stuck"))
            tokens = sum((r.get("usage") or {}).get("completion_tokens", 0) for r in results)
            texts = [c.get("text", (c.get("message") or {}).get("content")) for r in results
                     for c in r.get("choices", [])[:1]]
            rows.append({"mode": mode, "case": name, "requests": len(results), "errors": len(errors),
                         **({"gpus": min(GPUS[mode], args.gpus_here)} if args.gpus else {}),
                         **({"gpus_in_use": placed} if placed is not None else {}),
                         "error_samples": errors[:3], "stuck": stuck, "tok_s": round(tokens / wall, 1),
                         "wall_s": round(wall, 2), "texts": texts})
        bad, stalled = leaked(cluster.url), stalls(cluster.url)
        for row in rows:
            row.update(leaked=bad, stalled=stalled)
            row["passed"] = not row["errors"] and not row["stuck"] and not bad and not stalled
            log.info("%-14s %-40s %s  %d req  %d errors  %d stuck  %.1f tok/s", mode, row["case"],
                     "PASS" if row["passed"] else "FAIL", row["requests"], row["errors"], row["stuck"], row["tok_s"])
    finally:
        cluster.stop()
    return rows


def same_text(rows: list[dict]) -> None:
    """Greedy cases against the first mode's (the colocated reference): the fraction of texts equal."""
    ref = {r["case"]: r["texts"] for r in rows if r["mode"] == rows[0]["mode"]}
    for r in rows:
        want = ref.get(r["case"])
        if want and (r["case"] in ("fresh", "32 identical at once", "repeated (full prefix hits, burst)")
                     or "long prompt" in r["case"]):
            r["same_text_as_" + rows[0]["mode"]] = sum(a == b for a, b in zip(r["texts"], want)) / max(1, len(want))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="colocated,1p1d-nccl,1p1d-tcp")
    p.add_argument("--out", required=True)
    p.add_argument("--served", default=None, help="the model name requests ask for (default: what --model serves)")
    p.add_argument("--timeout", type=float, default=120.0, help="a request not answered by then counts as stuck")
    p.add_argument("--gpus", action="store_true", help="spread each mode's workers over its GPUs (pdserve up --gpus); "
                   "a mode of more GPUs than the machine has shares them, said in its rows")
    p.add_argument("--long", type=int, default=0, help="instead of the usual cases: a prompt of this many tokens, "
                   "again, and one over the context (the long-context case)")
    args, up = p.parse_known_args(argv)
    args.up = up
    args.gpus_here = max(1, len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.split(
        "\n")) - 1) if args.gpus else 1
    if args.served is None:
        model = up[up.index("--model") + 1] if "--model" in up else "tiny-llama"
        args.served = model.rstrip("/").rsplit("/", 1)[-1]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rows = []
    for mode in args.modes.split(","):
        try:
            rows += run_mode(mode, args)
        except Exception as e:  # a mode that cannot start is a failed case, and the others still run
            log.error("mode %s failed: %r", mode, e)
            rows.append({"mode": mode, "case": "start", "passed": False, "errors": 1, "error_samples": [repr(e)]})
    same_text(rows)
    for r in rows:
        r.pop("texts", None)
    passed = sum(bool(r.get("passed")) for r in rows)
    with open(args.out, "w") as f:
        json.dump({"cases": rows, "passed": passed, "failed": len(rows) - passed, "up": args.up,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"{passed} passed, {len(rows) - passed} failed")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
