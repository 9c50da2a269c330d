"""``pdserve plan placement``: contiguous layer ranges that fit each node's weights and the KV of the context."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner.placement import (PlacementError, Node, Shape, bytes_per_weight, model_config, place,
                                  place_stage_zero, weights_only)

MACS = [Node("studio1", 128), Node("studio2", 128), Node("macbook", 36)]


def minimax_5bit() -> Shape:
    return Shape.of(model_config("minimax-m2-230b"), bytes_per_weight("bfloat16", 5))


def covers(stages, layers: int) -> bool:
    return [s.first for s in stages] == [0] + [s.last for s in stages[:-1]] and stages[-1].last == layers


def test_three_macs_give_the_macbook_fewer_layers_and_everything_fits_200k_tokens():
    shape = minimax_5bit()
    assert 150 < shape.weight_bytes / 1e9 < 165 and shape.layers == 62  # ~230B parameters at 5.5 bits
    with pytest.raises(PlacementError, match="at most 61 of 62"):  # the MacBook last: a studio holds embed + head
        place(MACS, shape, 200_000)
    stages, naive = place_stage_zero(MACS, shape, 200_000), weights_only(MACS, shape, 200_000)
    assert covers(stages, 62) and covers(naive, 62)
    assert [s.node.name for s in stages] == ["macbook", "studio1", "studio2"]  # stage 0 on the MacBook fits
    assert all(s.fits and s.max_tokens >= 200_000 for s in stages)
    assert stages[0].layers < naive[2].layers
    assert not naive[2].fits and naive[2].max_tokens < 200_000  # by weights alone the MacBook runs out of memory


def test_a_cluster_too_small_is_refused_with_the_numbers():
    with pytest.raises(PlacementError, match=r"needs 208\.\d GB \(weights 157\.\d GB \+ KV 50\.\d GB\).*92\.0 GB"):
        place([Node("a", 64), Node("b", 64)], minimax_5bit(), 200_000)


def test_gpu_cases_split_evenly_and_refuse_what_does_not_fit():
    shape = Shape.of(model_config("llama-3-70b"), bytes_per_weight("bfloat16", None))
    h100, h200 = [Node(f"h100-{i}", 80) for i in range(2)], [Node(f"h200-{i}", 141) for i in range(2)]
    with pytest.raises(PlacementError, match="at most"):
        place(h100, shape, 8192 * 8, usable=0.9)
    stages = place(h200, shape, 8192 * 8, usable=0.9)
    assert [s.layers for s in stages] == [40, 40] and all(s.fits for s in stages)
    four = place([Node(f"g{i}", 80) for i in range(4)], shape, 8192 * 8, usable=0.9)
    assert [s.layers for s in four] == [20, 20, 20, 20]


def test_speeds_share_the_layers_within_what_each_node_holds():
    shape = Shape.of(model_config("mistral-7b"), bytes_per_weight("bfloat16", None))
    fast_small = [Node("fast", 24, speed=3.0), Node("slow", 128, speed=1.0)]
    stages = place(fast_small, shape, 4096, usable=0.9)
    assert covers(stages, 32) and all(s.fits for s in stages)
    assert stages[0].layers == 24  # 3/4 of the layers by speed, and 24 GB holds them
    tight = place([Node("fast", 12, speed=3.0), Node("slow", 128, speed=1.0)], shape, 4096, usable=0.9)
    assert tight[0].layers < 24 and all(s.fits for s in tight)  # moved to the node with room


def test_nodes_and_models_are_checked():
    for bad in ("macbook", "m:-1", "m:36:0", ":36"):
        with pytest.raises(ValueError, match="node"):
            Node.parse(bad)
    with pytest.raises(ValueError, match="no model"):
        model_config("gpt-9")


def test_the_command_prints_and_writes_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "pdserve", "plan", "placement", "--nodes",
                          "studio1:128,studio2:128,macbook:36", "--model", "minimax-m2-230b", "--bits", "5",
                          "--max-model-len", "200000", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "macbook runs out of memory at" in run.stdout and "stage 0 (which also holds" in run.stdout
    assert "layers per stage: 6,28,28  (pdserve up --pp 3 --pp-layers 6,28,28)" in run.stdout
    plan = json.loads(out.read_text())
    assert [s["last"] - s["first"] for s in plan["stages"]] == [6, 28, 28] and all(s["fits"] for s in plan["stages"])
    assert plan["stages"][0]["node"] == "macbook"
    refused = subprocess.run([sys.executable, "-m", "pdserve", "plan", "placement", "--nodes", "a:64,b:64",
                              "--model", "minimax-m2-230b", "--bits", "5", "--max-model-len", "200000"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "cannot hold this model" in refused.stdout
