"""What KV tiers of a given size buy on a trace (``pdserve plan --trace T --profile P --tier-gb 0,500,1000``).

One prompt-computing worker whose GPU pool holds the profile's ``kv_capacity_tokens`` and whose tier below holds
``GB`` more at the profile's KV bytes a token: an LRU over the trace's blocks at that total (``planner.reuse``) says
which prompt tokens each request takes from the cache. A request's prompt time is then the profile's prefill of
its uncached part after its cached prefix (``prefill_ms(prompt) - prefill_ms(cached)``: the later tokens of a
causal prompt pay for the keys before them) plus the cached part's load from the tier at ``tier_gb_s`` (tokens the
pool itself still holds are counted as loaded too: an upper bound on the load). Queueing is not modelled: these
are the prompt times of an idle worker, and the GPU-seconds of prefill the tier saves."""
from __future__ import annotations

from .reuse import reused_tokens
from .stats import quantile


def tier_rows(requests, profile, sizes_gb: list[float], block_size: int, tier_gb_s: float) -> list[dict]:
    pool = profile.kv_capacity_tokens or 0
    rows = []
    for gb in sizes_gb:
        capacity = (pool + int(gb * 1e9 / profile.kv_bytes_per_token)) // block_size
        cached = reused_tokens(requests, block_size, capacity)
        times = [profile.prefill_ms(r.prompt_tokens) - profile.prefill_ms(c)
                 + c * profile.kv_bytes_per_token / (tier_gb_s * 1e9) * 1e3 for r, c in zip(requests, cached)]
        computed = sum(profile.prefill_ms(r.prompt_tokens) - profile.prefill_ms(c) for r, c in zip(requests, cached))
        rows.append({"tier_gb": gb, "capacity_blocks": capacity,
                     "reused_share": sum(cached) / max(1, sum(r.prompt_tokens for r in requests)),
                     "prompt_ms_mean": sum(times) / len(times), "prompt_ms_p90": quantile(sorted(times), 0.9),
                     "prefill_gpu_s": computed / 1e3})
    return rows


def table(rows: list[dict], block_size: int) -> str:
    base = rows[0]["prefill_gpu_s"] or 1e-9
    lines = [f"| tier (GB) | capacity ({block_size}-token blocks, pool + tier) | prompt tokens reused | prompt time "
             "mean / p90 (ms, idle worker) | prefill GPU-s | vs the first row |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tier_gb']:g} | {r['capacity_blocks']} | {r['reused_share']:.1%} | "
                     f"{r['prompt_ms_mean']:.0f} / {r['prompt_ms_p90']:.0f} | {r['prefill_gpu_s']:.0f} | "
                     f"{r['prefill_gpu_s'] / base:.2f}x |")
    return "\n".join(lines)
