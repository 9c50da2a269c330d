"""The GPU suite's long-context case (``bench.gpu_suite --long``) on the CPU with the tiny model: a prompt near the
context served colocated and 1P1D over tcp with the same greedy text, again from the prefix cache, and a prompt one
token over the context refused with a 400 at once; no block left taken."""
import json
import sys

from bench import gpu_suite


def test_the_long_context_case_passes_colocated_and_disaggregated(tmp_path, monkeypatch):
    out = tmp_path / "long.json"
    monkeypatch.setattr(sys, "argv", ["gpu_suite"])
    assert gpu_suite.main(["--modes", "colocated,1p1d-tcp", "--long", "900", "--out", str(out), "--no-warmup"]) == 0
    rows = json.loads(out.read_text())["cases"]
    assert len(rows) == 6 and all(r["passed"] and not r["leaked"] for r in rows)
    assert all(r["same_text_as_colocated"] == 1.0 for r in rows if "long prompt" in r["case"])
    assert [r["case"] for r in rows][2] == "a prompt over the context (1025 tokens): 400 at once"
