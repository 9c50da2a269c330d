"""``pdserve bench kernels --only prefetch``: does o's weight pulled into L2 beside attention make o faster?

Per o weight (bf16 and FP8, copies rotating past L2 so each is read from
memory, as in a decode step) and per way of pulling (``triton_prefetch``'s
modes), inside one CUDA graph: a spin kernel standing in for attention (a
window of ``WINDOW_US`` in which memory is idle) then o's batch-1 kernel,
against the same with the pull forked onto the side stream during the
window. ``o_ms`` is o alone (and o read twice in a row: the second from
L2, the most a pull can give); ``window_o_ms`` / ``prefetched_ms`` the window
plus o without / with the pull; ``pull_ms`` the pull alone. What the engine
gains a layer is ``window_o_ms - prefetched_ms``."""
from __future__ import annotations

import torch

from .kernel_cases import timed, timed_rotating
from .kernel_fused import rotating_layers

WINDOW_US = (6.0, 9.0)


def _spin_cycles(us: float, device) -> int:
    """Cycles of ``torch.cuda._sleep`` lasting ``us`` here (measured: clocks differ between GPUs)."""
    probe = 200_000
    ms = timed(lambda: torch.cuda._sleep(probe), device, reps=20)
    return max(1, int(probe * us / (ms * 1000)))


def _o_kernel(fp8: bool):
    from engine.kernels import triton_gemv

    if fp8:
        return lambda x, layer: layer(x)
    return lambda x, layer: triton_gemv.linear(x, layer)


def prefetch_cases(spec, dtype, device) -> list:
    from engine.kernels import triton_prefetch as tp

    side = tp.side_stream(device)
    h, o_in = spec.hidden_size, spec.num_heads * spec.head_dim
    rows = []
    for fp8 in (False, True):
        layers = rotating_layers(h, o_in, fp8, dtype, device)
        x = torch.randn(1, o_in, dtype=dtype, device=device)
        o = _o_kernel(fp8)
        kind = "fp8" if fp8 else "bf16"
        nbytes = layers[0].weight.numel() * layers[0].weight.element_size()
        o_ms = timed_rotating(lambda layer: o(x, layer), layers, device)
        o_l2 = timed_rotating(lambda layer: (o(x, layer), o(x, layer)), layers, device) - o_ms  # the second from L2
        rows.append({"name": f"{kind} o read twice: the second read", "ms": o_l2, "o_ms": o_ms,
                     "note": f"o from memory {o_ms * 1000:.1f} us, again right after (from L2) {o_l2 * 1000:.1f} us"})
        for us in WINDOW_US:
            cycles = _spin_cycles(us, device)
            plain = timed_rotating(lambda layer: (torch.cuda._sleep(cycles), o(x, layer)), layers, device)
            for mode in tp.MODES:
                if mode == "bulk" and torch.cuda.get_device_capability(device)[0] < 9:
                    continue

                def pulled(layer, mode=mode):
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        tp.l2(layer.weight, mode)
                    torch.cuda._sleep(cycles)
                    torch.cuda.current_stream().wait_stream(side)
                    return o(x, layer)

                try:
                    pull_ms = timed_rotating(lambda layer, mode=mode: tp.l2(layer.weight, mode), layers, device)
                    ms = timed_rotating(pulled, layers, device)
                except Exception as e:  # noqa: BLE001 - a mode this GPU or Triton cannot build: reported
                    rows.append({"name": f"{kind} o, {us:g} us window, {mode}", "ms": float("nan"),
                                 "note": f"error: {str(e)[:100]}"})
                    continue
                rows.append({"name": f"{kind} o, {us:g} us window, {mode}", "ms": ms, "weight_bytes": nbytes,
                             "o_ms": o_ms, "window_o_ms": plain, "prefetched_ms": ms, "pull_ms": pull_ms,
                             "saved_us": (plain - ms) * 1000,
                             "note": f"o alone {o_ms * 1000:.1f} us, window + o {plain * 1000:.1f}, with the "
                                     f"pull {ms * 1000:.1f} (saves {(plain - ms) * 1000:.1f}); pull alone "
                                     f"{pull_ms * 1000:.1f} us"})
        del layers
        torch.cuda.empty_cache()
    return rows
