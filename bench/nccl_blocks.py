"""The checks of ``bench.nccl_check`` that move KV held in the blocks of a paged pool (both workers' shape):
pieces sent from blocks and landed into blocks (``PoolRows`` by index, a list of views, a whole buffer
scattered), and a request aborted while its KV lands (the send completes, the landing is released, the pair
survives); with the KV makers both ends share."""
from __future__ import annotations

import threading
import time

import torch

BLOCK = 16  # "/blocks" payloads: sent from the blocks of a paged pool into the blocks of another (as the workers do)


def kv(shape, dtype, seed, device, strided=False):
    g = torch.Generator(device=device).manual_seed(seed)
    layers, heads, tokens, dim = shape
    out = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            t = torch.randn(tokens, heads, dim * (2 if strided else 1), generator=g, device=device).to(dtype)
            pair.append(t[:, :, ::2] if strided else t)
        out.append(tuple(pair))
    return out


def same(want, got) -> bool:
    return all(torch.equal(a.contiguous().view(torch.uint8), b.view(torch.uint8))
               for pa, pb in zip(want, got) for a, b in zip(pa, pb))


PIECES = (6, 2, 100, 8)  # layers, kv heads, tokens, head dim
SRC_TABLE = [3, 4, 5, 9, 10, 20, 0]  # 16-token blocks of the sender's pool, three runs
DST_TABLES = {"pieces-into-blocks": [40, 41, 42, 7, 8, 9, 10, 30, 31, 2, 3, 4, 60],  # 8-token blocks
              "whole-into-blocks": [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]}


def send_pieces(s, dest, device) -> int:
    """KV in the blocks of a paged pool sent as pieces (into blocks of another block size, into a buffer), and
    whole tensors into blocks; returns the bytes the piece sends staged (none expected)."""
    from engine.kv_pool import KVPool
    from kvtransfer import PiecewiseKV, PoolRows
    from kvtransfer.tensors import layout_of

    L, H, T, D = PIECES
    want = kv(PIECES, torch.bfloat16, 77, device)
    pool = KVPool(L, 32, 16, H, D, torch.bfloat16, device)
    pool.scatter(SRC_TABLE, want)
    layout, before = layout_of(want), s.staged_bytes
    rows = PiecewiseKV(layout, PoolRows(pool.flat, pool.spans(SRC_TABLE, T), index_above=0))  # copied by index
    pieces = PiecewiseKV(layout, pool.pieces(SRC_TABLE, T))  # a list of views: copied by ``cat``
    s.send(dest, "pieces-into-blocks", layout, rows)
    s.send(dest, "pieces-into-buffer", layout, pieces)
    staged = s.staged_bytes - before
    s.send(dest, "whole-into-blocks", layout, want)
    return staged


def in_pool(layers, device):
    """``layers`` copied into consecutive blocks of a paged pool, as a ``PiecewiseKV`` of those blocks."""
    from engine.kv_pool import KVPool
    from kvtransfer import PiecewiseKV
    from kvtransfer.tensors import layout_of

    layout = layout_of(layers)
    table = list(range(-(-layout.num_tokens // BLOCK)))
    pool = KVPool(layout.num_layers, len(table), BLOCK, layout.num_kv_heads, layout.head_dim, layers[0][0].dtype, device)
    pool.scatter(table, layers)
    return PiecewiseKV(layout, pool.pieces(table, layout.num_tokens))


def land_in_blocks(r, device):
    """A decode-like pool of 8-token blocks that the transfers named in ``DST_TABLES`` land in; the "/blocks"
    payloads land in consecutive blocks of a pool made for their shape."""
    from engine.kv_pool import KVPool
    from kvtransfer import Landing, PiecewiseKV, PoolRows
    from kvtransfer.tensors import TORCH_DTYPES

    L, H, T, D = PIECES
    pool, pools = KVPool(L, 64, 8, H, D, torch.bfloat16, device), {}

    def land(tid, layout):
        if tid == "cancelled-mid":  # the sender cancels while this end holds its GRANT back
            time.sleep(1.0)
            return None
        if tid == "aborted-mid":  # the request is cancelled while its KV arrives: aborted once its landing is given
            r.abort(tid)
            table = DST_TABLES["whole-into-blocks"]
            return Landing(PiecewiseKV(layout, pool.pieces(table, T)), lambda: r.released_landings.append(tid))
        if tid in DST_TABLES:  # into blocks by index (``PoolRows``), or through a list of views
            table = DST_TABLES[tid]
            rows = PoolRows(pool.flat, pool.spans(table, T), 0) if tid == "pieces-into-blocks" else pool.pieces(table, T)
            return Landing(PiecewiseKV(layout, rows), lambda: None)
        if "/blocks-" not in tid:
            return None
        key = tid.rsplit("-", 1)[0]
        table = list(range(-(-layout.num_tokens // BLOCK)))
        if key not in pools:
            pools[key] = KVPool(layout.num_layers, len(table), BLOCK, layout.num_kv_heads, layout.head_dim,
                                TORCH_DTYPES[layout.dtype], device)
        return Landing(PiecewiseKV(layout, pools[key].pieces(table, layout.num_tokens)), lambda: None)
    r.land, r.released_landings = land, []
    return pool


def receive_pieces(r, pool, device) -> dict:
    T = PIECES[2]
    want = kv(PIECES, torch.bfloat16, 77, device)
    checks = {}
    for name in ("pieces-into-blocks", "pieces-into-buffer", "whole-into-blocks"):
        got = r.wait(name, 60)
        if name in DST_TABLES:
            checks[name] = got.landed is not None and same(want, pool.gather(DST_TABLES[name], T))
        else:
            checks[name] = got.landed is None and same(want, [(k.clone(), v.clone()) for k, v in unpack_of(got)])
        got.release()
    return checks


def mid_abort_sent(s, dest, device) -> dict:
    """Sender: a KV the receiver aborts as it lands (``land_in_blocks``), then another, then one this end cancels
    while it waits for the GRANT and one it cancels while that one holds the turn (the prefill worker cancels a push
    whose request went away): all but the last complete, the last never begins, and no pair is aborted."""
    from kvtransfer.transports.nccl import pairs as nccl_pairs

    out, broken = {}, len(nccl_pairs.broken)
    for name, seed in (("aborted-mid", 78), ("after-abort-mid", 79)):
        out.update(mid_send(s, dest, name, kv(PIECES, torch.bfloat16, seed, device)))
    sends = [threading.Thread(target=lambda n=name, w=kv(PIECES, torch.bfloat16, seed, device):
                              out.update(mid_send(s, dest, n, w)))
             for name, seed in (("cancelled-mid", 80), ("queued-cancelled", 81))]
    for t in sends:  # the second waits its turn behind the first, whose GRANT the receiver holds back for 1 s
        t.start()
        time.sleep(0.1)
    time.sleep(0.2)
    s.cancel("cancelled-mid")
    s.cancel("queued-cancelled")
    for t in sends:
        t.join()
    out["pairs_aborted_by_mid_abort"] = len(nccl_pairs.broken) - broken
    return out


def mid_send(s, dest, name, want) -> dict:
    from kvtransfer import TransferError
    from kvtransfer.tensors import layout_of

    try:
        s.send(dest, name, layout_of(want), want)
        return {f"{name}_sent": True}
    except TransferError as e:
        return {f"{name}_sent": f"{e}"[:200]}


def mid_abort_received(r, device) -> dict:
    """Receiver: the aborted KV is not delivered and its landing is released; the next one arrives bit-exact, and so
    does the one its sender cancelled mid-send."""
    from kvtransfer import TransferError
    from kvtransfer.tensors import materialize
    from kvtransfer.transports.nccl import pairs as nccl_pairs

    got = r.wait("after-abort-mid", 60)
    checks = {"after_abort_mid": same(kv(PIECES, torch.bfloat16, 79, device), materialize(got, device))}
    got.release()
    try:
        r.wait("aborted-mid", 5)
        checks["abort_mid"] = False
    except TransferError:
        checks["abort_mid"] = True
    checks["abort_mid_released_its_landing"] = r.released_landings == ["aborted-mid"]
    got = r.wait("cancelled-mid", 60)  # a cancel on the sending side: the KV still arrives whole
    checks["cancelled_mid_arrived"] = same(kv(PIECES, torch.bfloat16, 80, device), materialize(got, device))
    got.release()
    checks["abort_mid_kept_the_pair"] = not nccl_pairs.broken
    return checks


def unpack_of(got):
    from kvtransfer.tensors import unpack
    return unpack(got.buffer, got.layout)
