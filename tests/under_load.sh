#!/usr/bin/env bash
# The tests whose conditions depend on timing or order (kills, retries, stalls, cached bursts, waits of about a
# second), run N times in a row (default 10) beside two CPU-burning processes: none may depend on how the OS
# schedules processes. Each run's pytest summary and time go to standard output.
#   bash tests/under_load.sh [N]      (after tests/run.sh made .venv)
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
python3 -c "while True: pass" & b1=$!
python3 -c "while True: pass" & b2=$!
trap 'kill $b1 $b2 2>/dev/null' EXIT
TESTS="tests/test_retry.py::test_up_decode_killed_then_eight_requests_at_once_all_succeed
tests/test_disagg_auto.py::test_local_prefill_next_to_a_decoding_stream_keeps_to_the_step_cap
tests/test_stall.py tests/test_request_ends.py
tests/test_guided.py::test_a_grammar_compiles_off_the_engine_thread_and_a_plain_request_does_not_wait
tests/test_pick_wait.py tests/test_admission.py tests/test_failures.py"
failed=0
for i in $(seq 1 "${1:-10}"); do
  start=$(date +%s)
  python -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -1 | sed "s/^/run $i: /" | tee /dev/stderr | grep -q failed && failed=1
  echo "run $i: $(( $(date +%s) - start )) s"
done
exit $failed
