"""``pdserve bench serve``: load against any OpenAI-compatible endpoint.

Requests stream with ``include_usage``; per request it records TTFT (first
content chunk), inter-token gaps (their p99 and the longest, the stall),
TPOT, end-to-end latency, output tokens and, when the server is pdserve, its
per-phase timings and where the prompt was prefilled. Fixed concurrency
(closed loop) or Poisson arrivals at ``--rate``; stops after ``--requests``
or ``--duration``; the first ``--warmup-requests`` run but are left out of
the summary. ``--workload mixed``: 70% prompts of 128-1,024 tokens, 30% of
6,000-8,000 (``planner.workload``). Goodput counts requests within every SLO
given: ``--slo-ttft-ms``, ``--slo-tpot-ms``, ``--slo-itl-p99-ms``,
``--slo-stall-ms``."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from planner.stats import quantile, summary
from planner.workload import WORKLOADS, Request, arrivals, build, parse_range, synthetic_prompt

from .health import settled_step_times, step_delta, with_busy
from deploy.progress import bar
from .report import command_line

PHASES = ("admit", "queue", "prefill", "d2h", "serialize", "wire", "deserialize", "convert", "h2d", "transfer_total", "overlap", "exposed",
          "decode", "ttft", "e2e")


def add_arguments(p):
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--duration", type=float, default=None, help="seconds; overrides --requests as the stop rule")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--prompt-len", default="128", help="N or LO:HI characters (≈ tokens for tiny-llama)")
    p.add_argument("--max-tokens", default="64", help="N or LO:HI")
    p.add_argument("--prompts-jsonl", default=None, help="rows of {prompt, max_tokens}")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-itl-p99-ms", type=float, default=None, help="SLO on each request's p99 token gap")
    p.add_argument("--slo-stall-ms", type=float, default=None, help="SLO on each request's longest token gap")
    p.add_argument("--workload", choices=WORKLOADS, default="uniform", help="mixed: 70%% 128-1k, 30%% 6-8k "
                   "prompts, 128-512 out (--prompt-len/--max-tokens ignored)")
    p.add_argument("--warmup-requests", type=int, default=0, help="the first N requests run, not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=0, help="multi-turn workload: this many conversations, each "
                   "sending its turns one after another (the prompt grows by the reply and the next question)")
    p.add_argument("--turns", type=int, default=8, help="multi-turn: turns per conversation")
    p.add_argument("--system-len", type=int, default=2000, help="multi-turn: characters of the system prompt all "
                   "conversations share")
    p.add_argument("--out", default="bench/out/serve")


async def one(client, url, model, endpoint, req, temperature, keep_text=False, extra: dict | None = None) -> dict:
    """One streamed request (``req.prompt``: text, or token ids on completions; ``extra``: more body fields)."""
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, **(extra or {})}  # a chunk a token
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": req.prompt}]
    else:
        path, body["prompt"] = "/v1/completions", req.prompt
    start = time.perf_counter()
    stamps, usage, timing, error, texts = [], None, {}, None, []
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"].get("message")
                        break
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text or choice.get("token_ids"):  # tokens that decode to no text (a byte tokenizer
                            stamps.append(time.perf_counter())  # on a large vocabulary) still count
                            texts.append(text or "")
                    usage = chunk.get("usage") or usage
                    timing = chunk.get("pdserve") or timing
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    out_tokens = (usage or {}).get("completion_tokens", len(stamps))
    row = {"error": error, "e2e_ms": (end - start) * 1e3, "output_tokens": out_tokens,
           "prompt_tokens": (usage or {}).get("prompt_tokens", 0), "pdserve": timing}
    if keep_text:
        row["text"] = "".join(texts)
    if stamps:
        row["ttft_ms"] = (stamps[0] - start) * 1e3
        row["itl_ms"] = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
        row["itl_p99_ms"] = quantile(row["itl_ms"], 0.99)
        row["stall_ms"] = max(row["itl_ms"], default=0.0)
        row["tpot_ms"] = (end - stamps[0]) * 1e3 / (out_tokens - 1) if out_tokens > 1 else 0.0
    return row


async def run_conversations(args) -> tuple[list[dict], float]:
    """Each conversation: system prompt, then per turn a question; the reply joins the prompt of the next turn."""
    rng = random.Random(args.seed)
    system = synthetic_prompt(rng, args.system_len)
    _, qhi = parse_range(args.prompt_len)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        model = args.model or (await client.get(args.url + "/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(args.concurrency)
        rows, start = [], time.perf_counter()
        progress = bar(args.conversations * args.turns, "requests", "req")

        async def talk(c):
            history = f"{system}\nConversation {c}.\n"
            for turn in range(1, args.turns + 1):
                history += f"User: {synthetic_prompt(rng, qhi)}\nAssistant:"
                req = Request(history, rng.randint(*parse_range(args.max_tokens)))
                async with gate:
                    row = await one(client, args.url, model, "completions", req, args.temperature, keep_text=True)
                row["turn"] = turn
                rows.append(row)
                progress.update()
                history += row.pop("text", "") + "\n"
        await asyncio.gather(*(talk(c) for c in range(args.conversations)))
        progress.close()
        return rows, time.perf_counter() - start


async def run_load(args) -> tuple[list[dict], float]:
    if getattr(args, "conversations", 0):
        return await run_conversations(args)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        model = args.model or (await client.get(args.url + "/v1/models")).json()["data"][0]["id"]
        count = args.requests if not args.duration else int(args.rate * args.duration * 1.5) + 50 if args.rate \
            else 1_000_000
        requests = build(min(count, 20_000), args.prompt_len, args.max_tokens, args.seed, args.prompts_jsonl,
                         getattr(args, "workload", "uniform"), rate=args.rate)
        offsets = arrivals(len(requests), args.rate, args.seed)
        gate = asyncio.Semaphore(args.concurrency)
        rows, start = [], time.perf_counter()
        deadline = start + args.duration if args.duration else None
        progress = bar(None if deadline else len(requests), "requests", "req")

        async def fire(index, req, offset):
            if deadline and start + offset > deadline:
                return  # arrives after the run's end: not sent
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if deadline and time.perf_counter() > deadline:
                return
            try:
                async with gate:
                    if deadline and time.perf_counter() > deadline:
                        return
                    row = await one(client, args.url, model, args.endpoint, req, args.temperature)
            except asyncio.CancelledError:  # given up (``give_up_s``): a miss, and the stream is closed
                rows.append({"error": "abandoned: still running when no answer could meet the SLO", "index": index,
                             "e2e_ms": (time.perf_counter() - start - offset) * 1e3, "output_tokens": 0,
                             "prompt_tokens": 0, "pdserve": {}})
                raise
            row["index"] = index
            rows.append(row)
            progress.update()
        tasks = [asyncio.ensure_future(fire(i, r, o)) for i, (r, o) in enumerate(zip(requests, offsets))]
        await _finish(tasks, start, deadline, offsets, getattr(args, "give_up_s", None))
        progress.close()
        return rows, time.perf_counter() - start


async def _finish(tasks, start, deadline, offsets, give_up_s):
    """All requests done, or, with ``give_up_s``, those still running that long after the last arrival cancelled."""
    if give_up_s is None or not tasks:
        await asyncio.gather(*tasks)
        return
    last = min(deadline, start + offsets[-1]) if deadline else start + offsets[-1]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, last + give_up_s - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def within(row: dict, slo: dict) -> bool:
    """``row`` (timed) meets every SLO in ``slo`` (keys ``ttft_ms``, ``tpot_ms``, ``itl_p99_ms``, ``stall_ms``)."""
    return all(limit is None or row.get(key, 0.0) <= limit for key, limit in slo.items())


def summarize(rows: list[dict], wall_s: float, slo_ttft=None, slo_tpot=None, slo_itl_p99=None, slo_stall=None,
              warmup: int = 0) -> dict:
    rows = [r for r in rows if r.get("index", warmup) >= warmup]
    slo = {"ttft_ms": slo_ttft, "tpot_ms": slo_tpot, "itl_p99_ms": slo_itl_p99, "stall_ms": slo_stall}
    ok = [r for r in rows if not r["error"]]
    timed = [r for r in ok if "ttft_ms" in r]
    good = [r for r in timed if within(r, slo)]
    out = {"requests": len(rows), "errors": len(rows) - len(ok), "wall_s": wall_s,
           "request_per_s": len(ok) / wall_s if wall_s else 0.0,
           "output_tok_per_s": sum(r["output_tokens"] for r in ok) / wall_s if wall_s else 0.0,
           "goodput_req_per_s": len(good) / wall_s if wall_s else 0.0, "goodput_fraction": len(good) / max(1, len(rows)),
           "ttft_ms": summary(r["ttft_ms"] for r in timed), "tpot_ms": summary(r["tpot_ms"] for r in timed),
           "itl_ms": summary(x for r in timed for x in r["itl_ms"]), "e2e_ms": summary(r["e2e_ms"] for r in ok),
           "itl_p99_ms": summary(r["itl_p99_ms"] for r in timed), "stall_ms": summary(r["stall_ms"] for r in timed),
           "warmup_requests": warmup}
    where = [r["pdserve"].get("disagg") for r in ok if r["pdserve"].get("disagg")]
    if where:
        out["disagg"] = {w: where.count(w) for w in sorted(set(where))}
    phases = {p: summary(r["pdserve"][p] for r in ok if isinstance(r["pdserve"].get(p), (int, float))) for p in PHASES}
    out["pdserve_ms"] = {p: s for p, s in phases.items() if s}
    if any("turn" in r for r in rows):
        out["ttft_ms_turn_1"] = summary(r["ttft_ms"] for r in timed if r.get("turn") == 1)
        out["ttft_ms_turns_2_on"] = summary(r["ttft_ms"] for r in timed if r.get("turn", 1) > 1)
        out["kv_bytes_turns_2_on"] = summary(r["pdserve"].get("kv_bytes", 0) for r in ok if r.get("turn", 1) > 1)
    return out


def run(args) -> int:
    from .report import write_serve_reports

    before = settled_step_times(args.url.rstrip("/"))  # a pdserve router's workers: their steps during the run
    rows, wall = asyncio.run(run_load(args))
    from .transfer import environment

    report = {"command": command_line("serve"), "url": args.url, "env": environment(),
              "summary": summarize(rows, wall, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_itl_p99_ms,
                                   args.slo_stall_ms, args.warmup_requests), "samples": rows}
    if before:
        report["summary"]["workers"] = with_busy(step_delta(before, settled_step_times(args.url.rstrip("/"))), wall)
    paths = write_serve_reports(report, args.out)
    print(paths.pop("markdown_text"))
    print("wrote " + ", ".join(paths.values()))
    return 0 if report["summary"]["errors"] == 0 else 1


def _parser_defaults(**overrides) -> argparse.Namespace:
    """``bench serve``'s arguments with their defaults, some overridden (for drivers that run it)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args
