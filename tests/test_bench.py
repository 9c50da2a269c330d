"""Fast runs of every bench code path (tiny payloads, few requests)."""
import json

from deploy.cli import main


def test_bench_transfer_tiny(tmp_path):
    out = tmp_path / "t"
    assert main(["bench", "transfer", "--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--tokens", "512", "--transports", "tcp,shm,pickle", "--reps", "2",
                 "--warmup", "1", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert {"socket", "tcp", "shm", "pickle"} <= set(report["summary"])
    assert len(report["samples"]["tcp"]) == 2 and report["summary"]["tcp"]["gbps"] > 0
    assert (tmp_path / "t.md").read_text().count("|") > 10 and (tmp_path / "t.png").stat().st_size > 1000


def test_bench_serve_against_running_cluster(disagg, tmp_path):
    out = tmp_path / "s"
    assert main(["bench", "serve", "--url", disagg.url, "--requests", "6", "--concurrency", "3", "--prompt-len",
                 "10:40", "--max-tokens", "4:8", "--slo-ttft-ms", "10000", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "s.json").read_text())
    s = report["summary"]
    assert s["requests"] == 6 and s["errors"] == 0 and s["goodput_fraction"] == 1.0
    assert s["ttft_ms"]["n"] == 6 and "wire" in s["pdserve_ms"] and s["output_tok_per_s"] > 0
    assert all(4 <= r["output_tokens"] <= 8 for r in report["samples"])


def test_bench_serve_poisson_and_chat(disagg, tmp_path):
    assert main(["bench", "serve", "--url", disagg.url, "--endpoint", "chat", "--requests", "4", "--rate", "20",
                 "--max-tokens", "3", "--prompt-len", "8", "--out", str(tmp_path / "p")]) == 0


def test_bench_compare_small(tmp_path):
    out = tmp_path / "c"
    assert main(["bench", "compare", "--transports", "tcp", "--requests", "2", "--rounds", "2", "--prompt-len", "16",
                 "--max-tokens", "4", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert set(report["results"]) == {"colocated", "tcp"}
    assert [len(r["samples"]) for r in report["results"].values()] == [4, 4]
    assert report["results"]["tcp"]["summary"]["pdserve_ms"]["wire"]["median"] > 0
    md = (tmp_path / "c.md").read_text()
    assert "| colocated |" in md and "1.000x, 1.000x" in md and "TTFT client ms" in md


def test_bench_idle_small(tmp_path):
    out = tmp_path / "i"
    assert main(["bench", "idle", "--prompt-len", "32", "--gap-ms", "5", "--reps", "2", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "i.json").read_text())
    assert list(report["summary"]) == ["back to back", "after decode", "after spin", "after sleep"]
    assert all(len(x) == 2 and min(x) > 0 for x in report["samples"].values())
    assert report["summary"]["after decode"]["vs_after_decode"] == 1.0


def test_bench_transfer_over_netns_link(tmp_path):
    import os
    import subprocess

    import pytest

    if os.geteuid() != 0:
        pytest.skip("netns link emulation needs root")
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert main(["bench", "transfer", "--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--tokens", "512", "--transports", "tcp", "--reps", "2", "--warmup", "1",
                 "--link", "netns:1gbit", "--out", str(tmp_path / "n")]) == 0
    report = json.loads((tmp_path / "n.json").read_text())
    assert report["link"] == "netns:1gbit" and len(report["samples"]["tcp"]) == 2
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


def test_bench_transfer_rejects_unknown_link(tmp_path):
    assert main(["bench", "transfer", "--preset", "tiny", "--link", "carrier-pigeon", "--out", str(tmp_path / "x")]) == 2
