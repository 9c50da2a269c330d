"""The operators' page (``/dashboard``) in a real browser, headless Chromium through Selenium, against ``pdserve up``:
it shows both workers healthy, its request counter follows requests sent with the openai SDK, a worker that stops
answering shows unhealthy, and once killed is healthy again with one restart, and the browser logs no error. Without a browser (Debian's
``chromium`` and ``chromium-driver``, which tests/run.sh installs where it can) the browser test is skipped, saying
so. Also: the page and its script are open, the state behind the API key; the script builds no markup from strings;
the Grafana dashboard queries only metrics the router exports."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from deploy.local import Cluster
from tests.fleet import Fleet
from tests.test_failures import eventually

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def _browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed")
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver (tests/run.sh does where it can)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def _cells(driver) -> list[list[str]]:
    """The workers table's cells, row by row, read in one call (the page redraws them every second)."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#workers tbody tr')].map(r => [...r.cells].map(c => c.textContent))")


def _requests(driver) -> int:
    text = driver.execute_script("const c = document.getElementById('requests-total'); return c ? c.textContent : ''")
    found = re.search(r"(\d+)\s*$", text or "")
    return int(found.group(1)) if found else -1


def _health(driver) -> dict:
    """``{role: (health, restarts)}`` as the page shows them."""
    return {row[0]: (row[2], row[7]) for row in _cells(driver)}


def test_the_dashboard_in_a_browser_follows_requests_and_a_killed_worker():
    driver = _browser()
    cluster = Cluster().wait_ready()
    try:
        driver.get(cluster.url + "/dashboard")
        assert eventually(lambda: _health(driver) == {"prefill": ("healthy", "0"), "decode": ("healthy", "0")}, 30), \
            _cells(driver)
        assert eventually(lambda: _requests(driver) >= 0, 10)
        before = _requests(driver)
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none")
        for i in range(3):
            client.completions.create(model="tiny-llama", prompt=f"dashboard {i}", max_tokens=8)
        assert eventually(lambda: _requests(driver) >= before + 3, 15), _requests(driver)
        pid = httpx.get(cluster.url + "/health", timeout=10).json()["workers"]["decode"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)  # silent: the router takes it out of the picks, and it stays so until killed
        try:
            assert eventually(lambda: _health(driver).get("decode", ("",))[0] == "unhealthy", 30), _cells(driver)
        finally:
            os.kill(pid, signal.SIGKILL)  # pdserve up restarts it
        assert eventually(lambda: _health(driver).get("decode") == ("healthy", "1"), 120), _cells(driver)
        shot = os.environ.get("PDSERVE_DASHBOARD_SCREENSHOT")
        if shot:  # (the README's example)
            for i in range(4):
                for _ in client.completions.create(model="tiny-llama", prompt=f"after the restart {i}", max_tokens=16,
                                                   stream=True):
                    pass
            time.sleep(2)
            driver.save_screenshot(shot)
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert errors == []
    finally:
        driver.quit()
        cluster.stop()


def test_the_page_is_open_and_its_state_needs_the_api_key(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-dash-123\n")
    with Fleet() as f:
        f.worker("p", "prefill")
        f.worker("d", "decode")
        f.router("--api-key-file", str(key))
        f.wait_healthy()
        page = httpx.get(f.url + "/dashboard", timeout=10)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert httpx.get(f.url + "/dashboard/page.js", timeout=10).status_code == 200
        assert httpx.get(f.url + "/dashboard/state", timeout=10).status_code == 401
        state = httpx.get(f.url + "/dashboard/state", headers={"Authorization": "Bearer sk-dash-123"}, timeout=10)
        assert state.status_code == 200
        body = state.json()
        assert {w["role"] for w in body["workers"]} == {"prefill", "decode"} and body["status"] is True
        assert set(body["traffic"]) >= {"requests_per_s", "ttft_ms", "tpot_ms", "itl_ms", "errors_per_s"}


def test_the_script_puts_strings_in_as_text_only():
    script = (ROOT / "router" / "dashboard" / "page.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script


def test_every_metric_the_grafana_dashboard_queries_is_one_the_router_exports():
    from prometheus_client import generate_latest

    from router.metrics import Metrics

    exported = set()
    for line in generate_latest(Metrics().registry).decode().splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            exported |= {name} | ({f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else set())
            exported |= {f"{name}_total"} if kind == "counter" else set()
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "pdserve.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queried |= set(re.findall(r"\b(pdserve_[a-z0-9_]+)", target["expr"]))
    assert queried and queried <= exported, sorted(queried - exported)


def test_the_state_shows_prompt_tokens_from_the_host_tier_and_its_moves():
    """A prompt pushed out of a small GPU pool comes back from the host tier: the dashboard's state counts its tokens
    (``tiers.tokens_per_s``, once the worker's counters arrive) and the move's fetch and load times, in the window
    that its first call opened."""
    cluster = Cluster("--colocated", "--no-warmup", "--kv-budget", str(40 * 16384),
                      "--kv-host-bytes", str(200 * 16384)).wait_ready()
    try:
        def complete(prompt):
            r = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        def state():
            return httpx.get(cluster.url + "/dashboard/state", timeout=10).json()["tiers"]
        assert state()["moves"] == 0  # the window's first sample: what follows is counted against it
        prompt = [(i * 37) % 200 + 40 for i in range(300)]
        complete(prompt)
        for n in range(6):  # 1,800 other tokens through a pool of 640: the prompt's blocks leave it
            complete([(i * 13 + n * 7) % 200 + 40 for i in range(300)])
        assert complete(prompt)["pdserve"]["cached_tokens_by_tier"].get("host", 0) > 0
        assert eventually(lambda: state()["tokens_per_s"]["host"] > 0, 10), state()
        tiers = state()
        assert tiers["moves"] >= 1 and tiers["phases_ms"]["load"] is not None and tiers["phases_ms"]["fetch"] >= 0
    finally:
        cluster.stop()
