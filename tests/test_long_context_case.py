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



def test_a_decode_worker_takes_a_transfer_over_the_limit_named_when_its_context_needs_it():
    """``--max-transfer-bytes`` far below one prompt's KV: the decode worker still takes any transfer a sequence of
    the model's whole context makes (a 100k-token prompt's 13 GB once hit an 8 GiB default and failed)."""
    import httpx

    from tests.fleet import Fleet

    with Fleet("--no-warmup") as f:
        f.pair(decode=("--max-transfer-bytes", "64K"))
        body = {"model": "tiny-llama", "prompt": gpu_suite.prompts(1, 9, 900)[0], "max_tokens": 8, "temperature": 0}
        r = httpx.post(f.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (900, 8)
