"""What a decode (or colocated) worker reports in its pongs (``info``): the router's picks, ``/health`` and the
metrics read it."""
from __future__ import annotations


def report(w) -> dict:
    e = w.engine
    return {"role": w.role, "model": e.name, "engine": getattr(e, "kind", "torch"), "transport": w.transport,
            "device": str(getattr(e, "device", "") or ""),
            "kv_addr": w.group_kv.kv_addr(w.receiver.address) if w.receiver else None,
            "kv_stages": w.group_kv.kv_stages(w.receiver.address) if w.receiver else None,
            "tp": 1 if getattr(e, "pipeline", None) else e.group.size, "pp": e.cfg.pp if hasattr(e, "cfg") else 1, "max_len": e.max_len,
            "active": len(w.live), "waiting": len(w.waiting) + len(w.blocked), "completed": w.completed,
            "kv_registrations": getattr(w.receiver, "registrations", 0),
            "kv_budget_bytes": w.kv_budget, "kv_bytes_per_token": e.kv_bytes_per_token,
            "kv_block_size": e.block_size, "kv_blocks": e.num_blocks, "kv_blocks_free": e.blocks.num_free,
            "kv_geometry": list(e.model_kv_shape), "kv_dtype": str(e.kv_dtype).removeprefix("torch."),
            "kv_reserved_bytes": sum(list(w.reserved.values())), "preemptions": e.scheduler.preemptions,
            "kv_landed_in_blocks": w.kv_landed, "kv_converted": w.kv_converted, "local_prefill": True,
            "local_prefills": w.local_prefills,
            "prefilling": sum(1 for live in list(w.live.values()) if live.colocated and not live.seq.num_output),
            **getattr(e, "step_info", dict)(),
            "kv_scattered_bytes": getattr(w.receiver, "scattered_bytes", 0),
            "kv_pool_bytes_in_use": getattr(getattr(w.receiver, "pool", None), "bytes_in_use", 0),
            "kv_pairs_aborted": getattr(getattr(w.receiver, "pairs", None), "aborted", 0),
            **w.moves.info(), **e.prefix_info()}
