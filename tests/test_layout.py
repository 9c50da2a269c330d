import msgpack
import pytest

from kvtransfer import KVLayout, LayoutError, PhaseTimes


def test_layout_sizes_match_mistral_shape():
    layout = KVLayout(32, 8, 128, 871, "float16")
    assert layout.tensor_nbytes == 8 * 871 * 128 * 2
    assert layout.total_nbytes == 32 * 2 * 8 * 871 * 128 * 2 == 114_163_712
    assert layout.layer_offset(3) == 3 * layout.layer_nbytes


def test_layout_roundtrips_through_msgpack():
    layout = KVLayout(80, 8, 128, 4096, "bfloat16")
    wire = msgpack.packb(layout.to_dict())
    assert KVLayout.from_dict(msgpack.unpackb(wire)) == layout


def test_fp8_layout_carries_its_scales():
    layout = KVLayout(2, 8, 128, 871, "float8_e4m3fn", (0.5, 1.0, 2.0, 0.25))
    back = KVLayout.from_dict(layout.to_dict())
    assert back == layout and back.scale_pairs() == [(0.5, 1.0), (2.0, 0.25)]
    assert layout.total_nbytes * 2 == KVLayout(2, 8, 128, 871, "bfloat16").total_nbytes
    assert KVLayout(2, 8, 128, 871, "float8_e4m3fn").scale_pairs() == [(1.0, 1.0)] * 2


@pytest.mark.parametrize("bad", [
    {"v": 2, "layers": 1, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "float16"},
    {"v": 4, "layers": 1, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "float16"},
    {"v": 3, "layers": 1, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "float16", "scales": [1.0, 1.0]},
    {"v": 3, "layers": 2, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "float8_e4m3fn", "scales": [1.0, 1.0]},
    {"v": 3, "layers": 1, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "float8_e4m3fn", "scales": [1.0, 0.0]},
    {"v": 3, "layers": 1, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "float8_e4m3fn", "scales": "ab"},
    {"v": 3, "layers": 0, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "float16"},
    {"v": 3, "layers": 1, "kv_heads": -1, "head_dim": 1, "tokens": 1, "dtype": "float16"},
    {"v": 3, "layers": 1, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "complex64"},
    {"v": 3, "layers": 1.5, "kv_heads": 1, "head_dim": 1, "tokens": 1, "dtype": "float16"},
    {"v": 3, "layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": "float16"},
    {"v": 3, "layers": 1, "kv_heads": 1, "head_dim": 1, "tokens": 1 << 40, "dtype": "float16"},
    [1, 2, 3],
])
def test_layout_rejects_invalid_descriptions(bad):
    with pytest.raises(LayoutError):
        KVLayout.from_dict(bad)


def test_phase_total_is_sum_of_phases():
    p = PhaseTimes(d2h=1, serialize=2, wire=3, deserialize=4, h2d=5, bytes=10)
    assert p.total == 15
    d = p.to_dict()
    assert d["total"] == 15 and PhaseTimes.from_dict(d) == p


def test_arena_recognises_only_its_own_canonical_regions():
    import torch

    from kvtransfer.arena import Arena

    arena = Arena(torch.empty(1 << 20, dtype=torch.uint8))
    layout = KVLayout(3, 2, 8, 5, "bfloat16")
    a, b = arena.source(layout), arena.source(layout)
    assert arena.region_of(layout, a.layers) == 0 and arena.region_of(layout, b.layers) > 0
    assert arena.region_of(layout, b) == b.offset > 0 and arena.region_of(KVLayout(3, 2, 8, 4, "bfloat16"), b) is None
    other = Arena(torch.empty(1 << 16, dtype=torch.uint8)).source(layout)
    assert arena.region_of(layout, other) is None
    swapped = a.layers[:-1] + [(a.layers[-1][1], a.layers[-1][0])]
    mixed = a.layers[:1] + b.layers[1:]
    copies = [(k.clone(), v.clone()) for k, v in a.layers]
    wrong = KVLayout(3, 2, 8, 5, "float16")
    for layers, lay in [(swapped, layout), (mixed, layout), (copies, layout), (a.layers[:2], layout), (a.layers, wrong)]:
        assert arena.region_of(lay, layers) is None
    a.release()
    assert arena.source(KVLayout(1, 1, 1, 1, "float32")) is not None
    assert arena.source(KVLayout(64, 8, 128, 512, "float32")) is None
