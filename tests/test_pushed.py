"""Batch-1 row-parallel all-reduces pushed by the one-row GEMVs (``engine.parallel.pushed``,
``engine.kernels.triton_pushed``) under Triton's interpreter, buffers in host memory, one process playing both ranks
(rank 1's push first, then rank 0's projection, which pulls right after its own push). A row-parallel projection
split over two ranks gives every rank the all-reduced row, step after step in the same slot; a step's stale words
are never read as the next step's; a rank that never pushes raises the error flag instead of hanging; the kernels
build for sm_90a. On two GPUs: bf16 TP=2 tokens and logprobs equal the one-shot all-reduce's bit for bit."""
import pytest
import torch

from tests.triton_env import DEVICE, needs_triton  # first: it sets the interpreter up where there is no GPU

pytestmark = needs_triton
host_only = pytest.mark.skipif(torch.cuda.is_available(), reason="one process plays both ranks in host memory")
DTYPE = torch.bfloat16
HIDDEN, INNER = 96, 160


class _Group:  # what ``triton_gemv.linear`` reads of a row-parallel layer's group
    def __init__(self, slots):
        self.pushed = slots

    def all_reduce(self, x):
        raise AssertionError("a pushed projection does not all-reduce")


def _ranks(world: int = 2, sites: int = 4):
    from engine.parallel.pushed import PushSlots

    buffers = [torch.zeros(sites * world * HIDDEN, dtype=torch.int32) for _ in range(world)]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    return buffers, [PushSlots(ptrs, r, world, HIDDEN, sites) for r in range(world)]


def _row_parallel(g, world: int):
    """A down projection ``[HIDDEN, INNER]`` and each rank's half of its input columns as a layer with a group."""
    full = torch.randn(HIDDEN, INNER, generator=g) * INNER ** -0.5
    parts = []
    for w in full.chunk(world, dim=1):
        lin = torch.nn.Linear(w.shape[1], HIDDEN, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        parts.append(lin.to(DEVICE, DTYPE))
    return parts


def _plain_sum(parts, xs):
    partial = [_plain_partial(lin, x) for lin, x in zip(parts, xs)]  # each rank's output, rounded as pushed
    return sum(p.float() for p in partial).to(DTYPE)


@host_only
def test_pushed_rows_sum_as_the_all_reduce_step_after_step(monkeypatch):
    from engine.kernels import triton_gemv, triton_pushed
    from engine.kernels.triton_pushed import push_row

    monkeypatch.setattr(triton_pushed, "SPIN_LIMIT", 50)  # a missing row fails the test instead of hanging it
    g = torch.Generator().manual_seed(5)
    _, slots = _ranks()
    parts = _row_parallel(g, 2)
    for step in range(3):  # the same site every step: each step's words replace the last's
        xs = [torch.randn(1, INNER // 2, generator=g).to(DTYPE) for _ in range(2)]
        want = _plain_sum(parts, xs)
        for r in range(2):
            slots[r].begin()
            parts[r].group = _Group(slots[r])
        push_row(slots[1], slots[1].site(), _plain_partial(parts[1], xs[1]))  # what rank 1's GEMV pushes
        got = triton_gemv.linear(xs[0], parts[0])  # rank 0: push, then pull
        _bf16_close(got, want)
        _bf16_close(slots[1].pull(0, torch.empty(1, HIDDEN, dtype=DTYPE)), want)
        assert int(slots[0].step.item()) == int(slots[1].step.item()) == step + 1
    assert all(int(s.error.item()) == 0 for s in slots)


def _bf16_close(got, want):
    """Equal but for the last bit (the interpreter rounds fp32 to bf16 toward zero, GPUs to nearest)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def _plain_partial(lin, x):
    from engine.kernels import triton_gemv

    saved = lin.__dict__.pop("group", None)
    try:
        return triton_gemv.linear(x, lin)
    finally:
        if saved is not None:
            lin.group = saved


@host_only
def test_stale_words_are_not_read_as_this_steps_and_a_silent_rank_raises_the_flag(monkeypatch):
    from engine.kernels import triton_pushed
    from engine.kernels.triton_pushed import push_row

    monkeypatch.setattr(triton_pushed, "SPIN_LIMIT", 3)
    _, slots = _ranks()
    for s in slots:
        s.begin()
    first = [torch.full((1, HIDDEN), float(r + 1)) for r in range(2)]
    for r in range(2):
        site = slots[r].site()
        push_row(slots[r], site, first[r])
    assert torch.equal(slots[0].pull(0, torch.empty(1, HIDDEN, dtype=DTYPE)), torch.full((1, HIDDEN), 3.0, dtype=DTYPE))
    assert int(slots[0].error.item()) == 0
    slots[0].begin()
    push_row(slots[0], slots[0].site(), torch.full((1, HIDDEN), 10.0))  # step 2: rank 1 never pushes
    slots[0].pull(0, torch.empty(1, HIDDEN, dtype=DTYPE))
    assert int(slots[0].error.item()) == 1  # rank 1's step-1 words were not taken for step 2's: it waited, gave up


@host_only
def test_slots_take_one_bf16_row_up_to_their_width_and_number_sites_per_forward():
    _, slots = _ranks()
    s = slots[0]
    assert s.takes(1, HIDDEN, DTYPE) and not s.takes(2, HIDDEN, DTYPE) and not s.takes(1, HIDDEN + 1, DTYPE)
    assert not s.takes(1, HIDDEN, torch.float16)
    s.begin()
    assert [s.site() for _ in range(4)] == [0, 1, 2, 3] and int(s.step.item()) == 1
    assert not s.takes(1, HIDDEN, DTYPE)  # every site used: the plain all-reduce
    s.begin()
    assert s.site() == 0 and int(s.step.item()) == 2


def test_the_kernels_build_for_hopper():
    from tests.triton_env import compile_for_hopper

    common = dict(RANK=0, WORLD=2, CAP=4096)
    cases = [("engine.kernels.triton_pushed", "_pull_kernel",
              {"push_ptr": "*i64", "step_ptr": "*i32", "err_ptr": "*i32", "out_ptr": "*bf16", "site": "i32",
               "n": "i32"}, dict(common, BLOCK=1024, SPIN_LIMIT=1 << 22, PDL=True)),
             ("engine.kernels.triton_pushed", "_push_kernel",
              {"x_ptr": "*fp32", "push_ptr": "*i64", "step_ptr": "*i32", "site": "i32", "n": "i32"},
              dict(common, BLOCK=1024))]
    for case, built in zip(cases, compile_for_hopper(cases)):
        assert "error" not in built, (case[1], built.get("error"))
        assert built["cubin_bytes"] > 0
    assert "ld.volatile.global" in compile_for_hopper(cases[:1])[0]["ptx"]


_TP2_RUN = """
import json, sys
from engine import EngineConfig, SamplingParams
from engine.engine import Engine
from tests.test_paged_engine import GREEDY, prompts
from tests.test_tp_overlap import outputs

engine = Engine(EngineConfig(model=sys.argv[1], device="cuda", tp=2, block_size=16, dtype="bfloat16"))
try:
    params = [SamplingParams(max_tokens=16, **GREEDY)]
    got = [outputs(engine, [p], params) for p in prompts(2, seed=17)]  # one at a time: batch 1
    pushed = engine.group.pushed
    print(json.dumps({"outputs": got, "pushed": pushed is not None, "replays": engine.runner.graphs.replays,
                      "error": int(pushed.error.item()) if pushed is not None else 0}))
finally:
    engine.close()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs")
def test_on_two_gpus_tp2_tokens_and_logprobs_are_the_one_shots(tmp_path):
    """bf16 TP=2 through the decode graphs at batch 1 (the one-row GEMVs): the pushed all-reduce gives the one-shot
    all-reduce's greedy tokens and logprobs bit for bit (two ranks: one fp32 sum, one rounding). Each engine in a
    process of its own (a process group and its symmetric memory once per process)."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_paged_engine import write_family

    path = write_family(tmp_path, "llama")
    got = {}
    for mode in ("oneshot", "auto"):
        env = {**os.environ, "PDSERVE_TP_ALLREDUCE": mode}
        run = subprocess.run([sys.executable, "-c", _TP2_RUN, str(path)], env=env, capture_output=True, text=True,
                             timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert run.returncode == 0, run.stderr[-3000:]
        got[mode] = json.loads(run.stdout.strip().splitlines()[-1])
        assert got[mode]["pushed"] == (mode == "auto"), (mode, run.stderr[-3000:])
        assert got[mode]["replays"] > 0 and got[mode]["error"] == 0
    assert got["auto"]["outputs"] == got["oneshot"]["outputs"]
