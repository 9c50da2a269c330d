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
python -m pytest -q "$@"
