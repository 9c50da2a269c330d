"""Every Triton kernel a decode step launches, built for Hopper (sm_90a) with Triton's own ptxas, no GPU needed: the
tiny model's steps run on the kernels under the interpreter (batch 1 through the GEMV, then a batch of three), each
launch's argument types and constexprs are recorded, and each distinct variant is built with programmatic dependent
launch on, as an H100 or H200 runs it. The interpreter runs the kernels' numbers; this catches what only a GPU build
would refuse (PTX modifiers, non-constexpr globals, PDL intrinsics)."""
import inspect
import json

import pytest
import torch

from tests.triton_env import needs_triton  # first: it sets the interpreter up where there is no GPU

pytestmark = needs_triton

POINTEE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
           torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
           torch.float8_e4m3fn: "fp8e4nv"}
ON_HOPPER = {"PDL": True, "EARLY": True}  # what the interpreter turns off and an H100/H200 launch turns on


def kernel_case(fn, args, kwargs) -> tuple:
    """``(module, name, signature, constexprs, options)`` of one launch of ``fn`` (the kernel's Python function)."""
    params = list(inspect.signature(fn).parameters.values())
    values = dict(zip((p.name for p in params), args))
    values.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    signature, constexprs = {}, {}
    for p in params:
        value = values.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            constexprs[p.name] = ON_HOPPER.get(p.name, value) if isinstance(value, bool) else value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + POINTEE[value.dtype]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        else:
            signature[p.name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return fn.__module__, fn.__name__, signature, constexprs, options


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels are built by running them")
def test_every_kernel_of_a_decode_step_builds_for_hopper(monkeypatch):
    from triton.runtime import interpreter

    from engine import SamplingParams
    from engine.generate import generate_many
    from tests.test_triton_gemv import batch1_on_the_kernels
    from tests.triton_env import compile_for_hopper

    cases = {}
    real = interpreter.InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        case = kernel_case(self.fn, args, kwargs)
        cases.setdefault(json.dumps(case, sort_keys=True, default=str), case)
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", record)
    engine, run, want = batch1_on_the_kernels()
    assert run() == want
    prompts = [engine.tokenizer.encode(p) for p in ("a b c", "hello there friend", "x")]
    generate_many(engine, prompts, [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)] * 3)
    _prompt_rope_store()  # prompt chunks of 128 tokens or more: a program per block of heads
    names = {case[1] for case in cases.values()}
    assert {"_one_row_kernel", "_decode_kernel", "_combine_kernel", "_rope_store_kernel",
            "_rope_store_heads_kernel"} <= names, names
    built = compile_for_hopper(list(cases.values()))
    failed = [(case[1], case[3], result["error"][-600:]) for case, result in zip(cases.values(), built)
              if "error" in result]
    assert not failed, failed
    assert all(result["cubin_bytes"] > 0 for result in built)


def _prompt_rope_store():
    """A GQA prompt chunk's rotary and K/V store (Mistral's 32 query and 8 KV heads) through the head-block kernel."""
    from engine.kernels import triton_attention
    from engine.models.rope import Rotary

    tokens, heads, kv_heads, dim = 4, 32, 8, 128
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    rotary = Rotary(dim, 64, 10000.0)
    pool = [torch.zeros(2, 16, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2)]
    triton_attention.rope_store(qkv, rotary.cos[:tokens], rotary.sin[:tokens], *pool, torch.arange(tokens), heads,
                                kv_heads, keep=True, heads_a_program=8)
