"""The barrier-free all-reduce (``engine.parallel.lamport``) under Triton's interpreter, buffers in host memory:
one process playing every rank (each rank's push, then each rank's pull), and ranks as processes of their own over
shared memory racing with push and pull in one launch as on GPUs. Sums equal on every rank and within bf16 rounding
of the reference, buffers back to the sentinel after every call whatever its size, a rank that never pushes raises
the error flag instead of hanging; the kernel builds for sm_90a."""
import os

import pytest
import torch

from tests.triton_env import needs_triton  # first: it sets the interpreter up where there is no GPU

pytestmark = needs_triton


def group(world: int, cap: int):
    from engine.parallel import lamport

    buffers = [torch.full((lamport.buffer_words(world, cap),), lamport.SENTINEL, dtype=torch.int16)
               for _ in range(world)]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    return buffers, [lamport.Lamport(ptrs, r, world, cap, torch.bfloat16) for r in range(world)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="one process plays every rank in host memory (interpreter)")
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_sum_call_after_call(world):
    from engine.parallel import lamport

    buffers, ops = group(world, cap=4096)
    g = torch.Generator().manual_seed(world)
    for call, n in enumerate([7, 4096, 1500, 1, 3000, 4096, 64]):  # sizes change between calls sharing a slot
        xs = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(world)]
        xs[0][0] = -0.0  # the sentinel's bits: sent as +0.0
        for r in range(world):
            ops[r](xs[r], phases=1)
        outs = [ops[r](xs[r], phases=2) for r in range(world)]
        want = sum(x.float() for x in xs)
        for r in range(world):  # every rank adds in the same order: equal; the reference within bf16's rounding
            assert torch.equal(outs[r], outs[0]), (call, r)
            torch.testing.assert_close(outs[r].float(), want, rtol=2 ** -7, atol=1e-6)
        assert all(bool((b == lamport.SENTINEL).all()) for b in buffers), call
        assert all(int(op.ticket.min()) == int(op.ticket.max()) == call + 1 for op in ops)
    assert not any(int(op.error.item()) for op in ops)


@pytest.mark.skipif(torch.cuda.is_available(), reason="one process plays every rank in host memory (interpreter)")
def test_a_rank_that_never_pushes_raises_the_error_flag_instead_of_hanging(monkeypatch):
    from engine.parallel import lamport

    monkeypatch.setattr(lamport, "SPIN_LIMIT", 3)
    _, ops = group(2, cap=1024)
    x = torch.ones(100, dtype=torch.bfloat16)
    ops[0](x)  # both phases; rank 1 never pushes
    assert int(ops[0].error.item()) == 1


def test_fits_only_its_dtype_and_size():
    from engine.parallel.lamport import Lamport

    op = Lamport(torch.zeros(2, dtype=torch.int64), 0, 2, 1024, torch.bfloat16)
    assert op.fits(torch.zeros(4, 256, dtype=torch.bfloat16))
    assert not op.fits(torch.zeros(4, 257, dtype=torch.bfloat16))
    assert not op.fits(torch.zeros(8, dtype=torch.float32))
    assert not op.fits(torch.zeros(8, 4, dtype=torch.bfloat16).t())


def test_the_kernel_builds_for_hopper():
    from engine.parallel import lamport
    from tests.triton_env import compile_for_hopper

    sig = {"inp_ptr": "*bf16", "out_ptr": "*bf16", "ptrs_ptr": "*i64", "ticket_ptr": "*i32", "err_ptr": "*i32",
           "n": "i32"}
    flags = dict(RANK=1, WORLD=2, CAP=1 << 19, BLOCK=lamport.BLOCK, GRID=lamport.GRID, PHASES=3,
                 SPIN_LIMIT=lamport.SPIN_LIMIT, PDL=True)
    (built,) = compile_for_hopper([("engine.parallel.lamport", "_lamport_kernel", sig, flags)])
    assert "error" not in built, built.get("error")
    assert built["cubin_bytes"] > 0 and "ld.volatile.global" in built["ptx"] and "griddepcontrol" in built["ptx"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs")
def test_on_two_gpus_it_sums_as_nccl_does_call_after_call_and_in_graphs(tmp_path):
    import json

    from bench.lab.allreduce import main

    assert main(["--gpus", "2", "--out", str(tmp_path / "ar")]) == 0
    rows = json.loads((tmp_path / "ar.json").read_text())["rows"]
    fitting = [r for r in rows if "lamport_us" in r]
    assert fitting and all(r["lamport_ok"] for r in fitting), rows


def _rank(rank: int, world: int, cap: int, buffers: list, sizes: list, queue) -> None:
    """One rank in a process of its own: the production launch (push and pull in one), racing the other ranks."""
    os.environ["TRITON_INTERPRET"] = "1"
    from engine.parallel.lamport import Lamport

    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)  # this process's mappings
    op = Lamport(ptrs, rank, world, cap, torch.bfloat16)
    g = torch.Generator().manual_seed(100 + rank)
    outs = [op(torch.randn(n, generator=g).to(torch.bfloat16)) for n in sizes]
    queue.put((rank, [o.float().tolist() for o in outs], int(op.error.item())))  # plain lists: the process ends


@pytest.mark.skipif(torch.cuda.is_available(), reason="ranks as processes over shared host memory (interpreter)")
def test_ranks_in_processes_of_their_own_race_and_still_sum():
    """Two ranks as processes over buffers in shared memory, each launching push and pull together as the engine
    does: no rank waits for another to finish a call, and every call's sum is right on both."""
    import torch.multiprocessing as mp

    from engine.parallel import lamport

    world, cap, sizes = 2, 2048, [5, 2048, 700, 2048, 1, 1300]
    buffers = [torch.full((lamport.buffer_words(world, cap),), lamport.SENTINEL, dtype=torch.int16).share_memory_()
               for _ in range(world)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, cap, buffers, sizes, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict((r, (outs, err)) for r, outs, err in (queue.get(timeout=240) for _ in range(world)))
    for p in procs:
        p.join(30)
    xs = [[torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
          for g in (torch.Generator().manual_seed(100 + r) for r in range(world))]
    for call in range(len(sizes)):
        want = sum(xs[r][call].float() for r in range(world))
        assert got[0][0][call] == got[1][0][call], call
        torch.testing.assert_close(torch.tensor(got[0][0][call]), want, rtol=2 ** -7, atol=1e-6)
    assert got[0][1] == got[1][1] == 0
    assert all(bool((b == lamport.SENTINEL).all()) for b in buffers)


def test_the_all_reduce_choice_is_checked(monkeypatch):
    from engine.parallel.allreduce import one_shot

    monkeypatch.setenv("PDSERVE_TP_ALLREDUCE", "fastest")
    with pytest.raises(ValueError, match="auto, oneshot, nccl, lamport"):
        one_shot(None, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setenv("PDSERVE_TP_ALLREDUCE", "lamport")
    assert one_shot(None, torch.bfloat16, torch.device("cpu")) is None  # CPU groups all-reduce through gloo
