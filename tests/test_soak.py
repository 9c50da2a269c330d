"""The soak benchmark, short: 32 concurrent streams for 15 s against ``pdserve up`` (the long runs are
``bench/results/soak-*``)."""
import json
import subprocess
import sys


def test_a_short_soak_has_no_errors_and_flat_memory(tmp_path):
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, "-m", "pdserve", "bench", "soak", "--streams", "32", "--duration", "15",
                        "--out", str(out), "--up-args", "--threads 1"], capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "soak.json").read_text())
    assert r.returncode == 0, (report["error_samples"], r.stderr[-2000:])
    assert report["errors"] == 0 and report["requests"] >= 32
    assert len(report["rss_growth_pct"]) == 3
    assert report["rss_total_growth_pct"] < 10, report["rss_growth_pct"]
    assert (tmp_path / "soak.md").read_text().startswith("# Soak: 32 streams")
