"""Which layers each pipeline stage holds: contiguous ranges, as even as can be, or as ``--pp-layers`` says
(layer counts per stage, e.g. ``10,22``: what ``pdserve plan placement`` prints)."""
from __future__ import annotations


def stage_spans(num_layers: int, pp: int, layers: str | None = None) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` per stage."""
    if pp < 1:
        raise ValueError("pp must be a positive integer")
    if layers:
        try:
            counts = [int(n) for n in str(layers).split(",")]
        except ValueError:
            raise ValueError(f"--pp-layers {layers!r} is not a list of layer counts like 10,22") from None
        if len(counts) != pp:
            raise ValueError(f"--pp-layers {layers!r} names {len(counts)} stages, --pp is {pp}")
        if any(n < 1 for n in counts) or sum(counts) != num_layers:
            raise ValueError(f"--pp-layers {layers!r}: every stage needs a layer and the counts must add up to the "
                             f"model's {num_layers} layers (they add up to {sum(counts)})")
    else:
        if pp > num_layers:
            raise ValueError(f"--pp {pp} is more stages than the model's {num_layers} layers")
        base, extra = divmod(num_layers, pp)
        counts = [base + (i >= pp - extra) for i in range(pp)]  # stage 0 (which also samples) gets the fewer
    spans, first = [], 0
    for n in counts:
        spans.append((first, first + n))
        first += n
    return spans


def layer_pieces(sources: list, own: tuple[int, int]) -> list[tuple[int, int]]:
    """The ranges ``[lo, hi)`` of layers in ``own`` that come from each of ``sources`` (``[first, end)`` each: the
    sending stages' layers), in layer order: how a KV moves between pipelines of different splits."""
    first, end = own
    return [(max(a, first), min(b, end)) for a, b in sources if max(a, first) < min(b, end)]


def layer_piece(rid: str, first: int) -> str:
    """The transfer id of the layers from ``first`` on that one piece of request ``rid``'s KV carries."""
    return f"{rid}:L{first}"
