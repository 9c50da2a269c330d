"""One request through the cluster, as an async stream of events.

Disaggregated: pick a prefill and a decode worker, ask prefill (with the decode worker's KV address), relay
``first`` as soon as it comes, then ask decode to continue and relay its ``tokens``/``done`` (``router.relay``).
Colocated: one ``generate`` to a colocated worker; so too when ``router.disagg`` decides a prompt is prefilled
locally, on its decode worker. A lost worker's request runs again elsewhere (``router.retry``), a stream from the
client's last token; any other ``error`` ends the stream. An attempt that ends early aborts its work on every worker
involved."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time

from .admission import estimate_prompt_tokens
from .disagg import Decision, DisaggPolicy
from .errors import ApiError
from .events import Delta, Finished
from .policy import cached_blocks, prompt_first
from .prompts import PromptTokenizer
from .migration import Migrations
from .relay import first_message, relay_tokens
from .retry import RequestRun, StreamError, WorkerFailure
from .waits import DECODING, WAITING_KV, Stalled, Waits
from .timing import close_timing, note_cached, note_hops
from .warmup import PairWarmer
from .workers import PICK_WAIT_S, pair_mismatch

_ids = itertools.count()
log = logging.getLogger(__name__)



def new_rid() -> str:
    return f"{os.getpid():x}-{next(_ids):x}-{os.urandom(4).hex()}"


class Service:
    def __init__(self, groups: dict, metrics, admission, first_timeout_s: float = 300.0, token_timeout_s: float = 60.0,
                 kv_aware: bool = False, tokenizer: str | None = None, retries: int = 2, retry_wait_s: float = 3.0,
                 disagg: DisaggPolicy | None = None, stall_timeout_s: float = 30.0, count_prompts: bool = False):
        self.disagg = disagg or DisaggPolicy()
        # each prompt's uncached tokens counted (tokenized here) for the prefill workers' waits: what ``auto``
        # decides on, and ``--roles auto`` reads as the pressure on prompts
        self.count_prompts = count_prompts or self.disagg.mode == "auto"
        self.retries = retries
        self.retry_wait_s, self.pick_wait_s = retry_wait_s, max(PICK_WAIT_S, retry_wait_s)
        self.kv_aware = kv_aware
        self.prompts = PromptTokenizer(tokenizer, groups)
        self.groups = groups
        self.metrics = metrics
        self.warmer = PairWarmer(self, groups, "never")  # the router's app sets its own (router.warmup)
        self.admission = admission
        self.inboxes: dict[str, asyncio.Queue] = {}
        self.waits = Waits(stall_timeout_s)  # every wait for a worker's message, and the stall watchdog
        self.first_timeout_s, self.token_timeout_s = first_timeout_s, token_timeout_s
        self.migrations = Migrations(metrics, admission, self._dispatch)  # decoding requests moved between decode workers (router.migration)

    @property
    def colocated(self) -> bool:
        return bool(self.groups.get("colocated") and self.groups["colocated"].clients)

    def models(self) -> set[str]:
        return {c.info.get("model") for g in self.groups.values() for c in g.healthy() if c.info.get("model")}

    def mismatches(self) -> list[str]:
        """Pairs of prefill and decode workers that cannot hand KV to each other (another model, another KV shape),
        each with the fix."""
        out = []
        for p in self.groups.get("prefill").clients if self.groups.get("prefill") else []:
            for d in self.groups.get("decode").clients if self.groups.get("decode") else []:
                problem = pair_mismatch(p.info, d.info)
                if problem:
                    out.append(f"prefill {p.address} and decode {d.address}: {problem}")
        return out

    def _roles(self) -> list[str]:
        """The roles a request needs a worker of (decode workers prefill themselves unless ``always``)."""
        if self.colocated:
            return ["colocated"]
        return ["prefill", "decode"] if self.disagg.mode == "always" else ["decode"]

    def ready(self) -> bool:
        """A worker of every role a request needs is in the picks, and each other configured role has answered once
        (at start-up ``auto`` would otherwise prefill long prompts locally until the prefill workers' first pong)."""
        roles = self._roles()
        needed = all(self.groups.get(r) and self.groups[r].healthy() for r in roles)
        heard = all(any(c.last_pong > 0 for c in g.clients)
                    for r, g in self.groups.items() if r not in roles and g.clients)
        return needed and heard

    def check_model(self, model: str) -> None:
        known = self.models()
        if not known:
            raise ApiError(503, "no healthy workers yet; try again shortly")
        if model not in known:
            raise ApiError(404, f"The model '{model}' does not exist; served: {sorted(known)}", param="model", code="model_not_found")

    async def _pick(self, role, prompt=None, avoid=(), never=()):
        """A worker of ``role`` in the picks, one in ``avoid`` only where no other is; never one in ``never``."""
        group, ready = self.groups.get(role), []
        if group is not None:
            ready = [c for c in await group.wait_healthy(avoid, self.pick_wait_s) if c not in never]
            ready = ready or [c for c in group.healthy() if c not in never]  # avoided ones before none
        if not ready:
            raise ApiError(503, f"no healthy {role} worker", headers={"Retry-After": "1"})
        return group.policy.pick(ready, prompt)

    async def _prompt(self, payload: dict, always: bool = False):
        return await self.prompts.keys(payload) if self.kv_aware or always else None

    async def _hold(self, decode, prefill, rid, inbox, prompt) -> list:
        """Ask the decode worker to keep the cached blocks of the prompt's prefix it reported; the keys of those it
        kept (prefill then sends only the rest)."""
        n = cached_blocks(decode, prompt)
        bs = decode.info.get("kv_block_size")
        if not n or bs != prefill.info.get("kv_block_size") or decode.info.get("model") != prefill.info.get("model"):
            return []
        keys = prompt.keys(int(bs), str(decode.info.get("model") or ""))[:n]
        decode.owned.add(rid)
        await decode.send("hold", rid=rid, keys=keys)
        msg = await self.waits.next(inbox, 10.0, "the decode worker's cached blocks")
        return keys[:int(msg.get("blocks") or 0)] if msg["op"] == "held" else []

    async def generate(self, payload: dict, rid: str):
        """Async generator of ``Delta``/``Finished``; raises ``StreamError``. Runs the request again on other
        workers after a failure that left its client with at most the first token, or after a lost worker, from the
        client's last token (``router.retry``)."""
        run = RequestRun(rid, payload, time.perf_counter())
        while True:
            try:
                async with contextlib.aclosing(self._attempt(run)) as events:
                    async for ev in events:
                        yield ev
                return
            except WorkerFailure as failure:
                if isinstance(failure, Stalled):
                    log.error("request %s: %s", rid, failure.message)
                    if self.figures_for(run) is not None:
                        self.metrics.stalled.labels(failure.role, failure.state).inc()
                if not run.may_retry(failure, self.retries):
                    raise
                run.blame(failure)
                if not await self._await_workers():
                    log.warning("request %s: no retry after %s: %s", rid, failure.reason,
                                "; ".join(f"{r}: {self.groups[r].describe()}" for r in self._roles()))
                    raise
                self.metrics.retries.labels(failure.reason).inc()
                log.warning("request %s: retry %d after %s (%s)", rid, run.attempt, failure.reason, failure.message)
            except ApiError as e:
                if run.first is None:
                    raise
                raise StreamError(e.status, e.message) from None  # the response has started: end it with an error

    async def warm_pair(self, prefill, decode, payload: dict) -> tuple[str, str]:
        """One request through ``prefill`` -> ``decode`` (``router.warmup``), every other worker avoided; the
        addresses of the pair that served it. Raises what a request would (no retry)."""
        others = {c for g in self.groups.values() for c in g.clients if c is not prefill and c is not decode}
        run = RequestRun(f"warm-{next(_ids)}", payload, time.perf_counter(), avoid=others, warm=True)
        async with contextlib.aclosing(self._attempt(run)) as events:
            async for _ in events:
                pass
        return run.workers["prefill"].address, run.workers["decode"].address

    async def _await_workers(self) -> bool:
        """Before a retry: whether a worker of each role it needs is in the picks, waiting ``retry_wait_s`` at
        most (for a restart, or the death of a hung worker to be noticed)."""
        roles = self._roles()
        end = time.monotonic() + self.retry_wait_s
        while not all(self.groups[r].healthy() for r in roles):
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.05)
        return True
    async def _attempt(self, run: RequestRun):
        """One pass of the request through the workers, under its own id."""
        rid, timing = run.attempt_rid, run.timing
        inbox = self.inboxes[rid] = asyncio.Queue()
        self.waits.track(rid, run)
        run.workers, run.involved, run.move, run.ignore, finished = {}, [], None, set(), False
        run.cached_tokens = run.cached_by_tier = None  # this attempt's prompt computation says
        involved = run.involved
        released = set()  # involved workers whose part is done (counted out of ``outstanding`` already)
        try:
            first_worker = run.where = await self._send_prompt(run, rid, inbox, involved)
            fresh = None
            if run.first is None or not run.local:  # a local resume goes on from the first token itself
                fresh = await first_message(self, inbox, run, first_worker)
                note_cached(run, fresh)  # the KV decode goes on from is this prefill's
            if not run.local and first_worker in involved:
                first_worker.release(rid)  # its prompt is done: a prefill worker's load is prompts, not streams
                released.add(first_worker)
            first_worker.prompt_tokens_out.pop(rid, None)  # a local prompt's wait is over too
            if run.first is None:
                first = run.first = fresh
                timing.update({k: first["timing"].get(k, 0.0) for k in ("queue", "prefill")},
                              ttft=(time.perf_counter() - run.t0) * 1e3)
                note_hops(run, "prefill", first["timing"])
                timing.update({k: v for k, v in first["timing"].items() if k.startswith("kv_tier_")})
                yield Delta(first["text"], [first["token"]], first.get("logprobs"), first.get("prompt_text"),
                            first.get("prompt_logprobs"), first["prompt_tokens"], run.cached_tokens)
            elif fresh is not None and fresh["token"] != run.first["token"]:
                log.info("request %s: the retry's prefill chose token %d, decode goes on from the client's %d",
                         rid, fresh["token"], run.first["token"])
            first, decode_worker = run.first, None if run.local else run.workers.get("decode")
            kv_tp = (fresh or first).get("kv_tp", 1)  # the prefill group whose head slices decode receives
            kv_pp = {"kv_pp": (fresh or first)["kv_pp"]} if (fresh or first).get("kv_pp") else {}  # its stages
            self.admission.adjust(rid, first["prompt_tokens"] + (first["params"].get("max_tokens") or 0))
            if first.get("finish_reason"):
                finished = True
                if decode_worker is not None:  # a KV streamed during prefill may be on its way: decode drops it
                    await self._abort(decode_worker, rid)
                yield Finished(first["finish_reason"], first["prompt_tokens"], 1,
                               close_timing(run, self.figures_for(run)), run.cached_tokens or 0)
                return
            run.state = DECODING
            if decode_worker is not None:
                run.where, run.state = decode_worker, WAITING_KV
                await self._dispatch(decode_worker, involved, rid, "decode", first_token=first["token"],
                                     prompt_ids=first["prompt_ids"], emitted=first["emitted"], params=first["params"],
                                     kv_tp=kv_tp, **kv_pp)
            async for ev in relay_tokens(self, run, inbox, first_worker):
                yield ev
            finished = True
            for worker in involved:
                worker.vouch()
        except Stalled:
            run.stalled = True
            raise
        finally:
            self.inboxes.pop(rid, None)
            self.waits.untrack(rid)
            self.admission.release(rid)
            for worker in involved:
                if worker not in released:
                    worker.release(rid)
                worker.owned.discard(rid)
                if not finished:
                    await self._abort(worker, rid, "stalled" if run.stalled else None)
            holder = run.workers.get("decode")
            if holder is not None:
                if not finished and holder not in involved:
                    await self._abort(holder, rid)  # its KV may be on the way already
                holder.owned.discard(rid)

    async def _send_prompt(self, run: RequestRun, rid: str, inbox, involved: list):
        """Reserve KV memory on the worker that will decode, send the prompt to the one that computes it (the
        same, colocated); returns the latter. Records both in ``run.workers`` as soon as they are chosen."""
        payload, first = run.payload, run.first
        max_new = (first or payload)["params"].get("max_tokens") or 1 << 20
        prompt = await self._prompt(payload)
        if first:
            known = first["prompt_tokens"]
        else:  # the ids when the router tokenized the prompt (kv-aware routing), else an upper bound from its bytes
            known = len(prompt.ids) if prompt is not None and prompt.ids else estimate_prompt_tokens(payload)
        tokens = known + max_new
        run.local = self.colocated
        role = "colocated" if self.colocated else "decode"
        t0 = time.perf_counter()
        prompts_to = None if self.colocated or self.disagg.mode == "never" else self.groups.get("prefill")
        avoid = run.avoid | (prompt_first(prompts_to.healthy(run.avoid), self.groups[role].clients) if prompts_to else set())
        held = run.workers[role] = await self.admission.acquire(self.groups[role], rid, tokens, prompt, avoid)
        run.timing["admit"] = run.timing.get("admit", 0.0) + (time.perf_counter() - t0) * 1e3
        if self.colocated or run.streamed:  # a stream resumed after a lost worker: computed again where it decodes
            run.local = True
            return await self._generate_here(run, held, rid, involved)
        decode = held
        if await self._decide(run, decode, prompt) == "local":
            run.local = True
            decode.prompt_tokens_out[rid] = run.uncached  # the wait it adds to the next local prompt
            return await self._generate_here(run, decode, rid, involved)
        # never the decode worker's own prefill side (a mixed worker): its KV would go to itself
        twins = {c for c in self.groups["prefill"].clients if c.address == decode.address}
        prefill = run.workers["prefill"] = await self._pick("prefill", prompt, run.avoid, never=twins)
        problem = pair_mismatch(prefill.info, decode.info)
        if problem:
            raise ApiError(500, f"prefill worker {prefill.address} cannot hand its KV to decode worker "
                                f"{decode.address}: {problem}")
        run.timing["transport"] = decode.info.get("transport")
        skip = await self._hold(decode, prefill, rid, inbox, prompt)
        stages = {"kv_stages": decode.info["kv_stages"]} if decode.info.get("kv_stages") else {}  # a pipeline's
        prefill.prompt_tokens_out[rid] = run.uncached  # its wait for the next prompt (``router.disagg``)
        await self._dispatch(prefill, involved, rid, "prefill", kv_dest=decode.info.get("kv_addr"), kv_skip=skip,
                             **stages, **payload)
        return prefill

    async def _generate_here(self, run: RequestRun, worker, rid: str, involved: list):
        """The prompt (and, on a retry, the client's tokens) computed on the worker that decodes it."""
        run.timing["transport"] = "none"
        resume = run.resume_state() if run.first else None
        await self._dispatch(worker, involved, rid, "generate", **run.payload, resume=resume)
        return worker

    async def _decide(self, run: RequestRun, decode, prompt) -> str:
        """Local or remote prefill (``router.disagg``); recorded in the timing (the response's ``pdserve``)."""
        if run.warm:
            return "remote"
        uncached = 0
        if self.count_prompts:  # the uncached tokens also go to the response (and to ``router.traffic``)
            keys = prompt if prompt is not None and prompt.ids is not None else await self._prompt(run.payload, True)
            total = len(keys.ids) if keys is not None and keys.ids is not None else estimate_prompt_tokens(run.payload)
            uncached = total - cached_blocks(decode, keys) * int(decode.info.get("kv_block_size") or 0)
            run.timing["uncached_tokens"] = uncached
        run.uncached = uncached
        healthy = self.groups["prefill"].healthy(run.avoid) if self.groups.get("prefill") else []
        others = [p for p in healthy if p.address != decode.address]  # a mixed worker is in both groups
        if healthy and not others:
            decision = Decision("local", "same_worker")
        else:
            decision = self.disagg.decide(uncached, others, decode)
        if decision.where == "local" and decode.info.get("local_prefill") is False:
            decision = Decision("remote", "decode_cannot_prefill")
        run.timing.update(disagg=decision.where, disagg_reason=decision.reason)
        if decision.wait_ms is not None:
            run.timing["disagg_wait_ms"] = round(decision.wait_ms, 1)
        if decision.local_ms is not None:
            run.timing["disagg_local_ms"] = round(decision.local_ms, 1)
        self.metrics.disagg.labels(decision.where, decision.reason).inc()
        return decision.where

    def figures_for(self, run: RequestRun):  # where run's figures go: nowhere for a pair's warm-up
        return None if run.warm else self.metrics

    async def _dispatch(self, worker, involved, rid, op, **fields):
        worker.outstanding += 1
        worker.owned.add(rid)
        involved.append(worker)
        await worker.send(op, rid=rid, **fields)

    async def _abort(self, worker, rid, reason=None):
        """``reason`` "stalled": the worker logs where the request stood in its scheduler."""
        try:
            await worker.send("abort", rid=rid, **({"reason": reason} if reason else {}))
        except Exception:
            pass

