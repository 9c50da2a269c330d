#!/usr/bin/env bash
# Sets up a virtual environment with every CPU-capable transport and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0                 # CPU build; install it before anything that needs torch
python -m pip install -q -e '.[test]'
python -m pip install -q --no-deps nixl nixl-cu12      # plain `nixl` would pull CUDA torch
if ! command -v iperf3 >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  timeout 180 apt-get install -y -q iperf3 >/dev/null 2>&1 || echo "iperf3 not installed; benchmarks fall back to a plain socket reference"
fi
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # Mooncake Store (--kv-pool mooncake) links libibverbs; the library alone, without device providers (with them, a
  # process that used UCX, the nixl transport, crashed at exit on a machine without RDMA devices)
  timeout 180 apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1 || echo "libibverbs1 not installed; the KV pool tests are skipped"
fi
if ! command -v chromedriver >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then  # the dashboard test
  timeout 300 apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || echo "chromium not installed; the browser test is skipped"
fi
# Two workers (pytest-xdist; a third was no faster on two cores: the suite is CPU-bound) for all but the tests marked
# `serial` (bounds of about a second, or host-wide state such as network namespaces), which then run alone so that
# no other test's load stretches their timings. PYTEST_WORKERS sets the count; 0 runs everything in one process.
# PDSERVE_TEST_CPU=FILE records each test's CPU and wall seconds (tests/conftest.py). Exit 5 (nothing selected,
# e.g. one file without serial tests) is fine.
rc=0
python -m pytest -q -n "${PYTEST_WORKERS:-2}" -m "not serial" --durations=25 "$@" || rc=$?
[ $rc = 5 ] && rc=0
src=0
python -m pytest -q -m serial "$@" || src=$?
[ $src = 5 ] && src=0
[ $rc = 0 ] && [ $src = 0 ]
